#!/usr/bin/env bash
# Post-start warm-up for a voxcpm-serve instance: once /ready says the model is loaded, runs a zero-shot and a HiFi
# warm-up (add_hifi, generate with it, delete it). Exits non-zero if any step fails.
# Usage: deployment/post_start_warmup.sh [BASE_URL]   (default $VOXCPM_URL, else http://127.0.0.1:8000; WAIT_S=900 seconds
# for /ready, the service's longest load; VOXCPM_API_KEY, else the first of NANOVLLM_API_KEYS, else the first key of
# NANOVLLM_API_KEYS_FILE, as the bearer key where the service requires one; PYTHON=python3 parses the answers)
set -euo pipefail
BASE="${1:-${VOXCPM_URL:-http://127.0.0.1:8000}}"
WAIT_S="${WAIT_S:-900}"
PY="${PYTHON:-python3}"
KEY="${VOXCPM_API_KEY:-${NANOVLLM_API_KEYS:-}}"
KEY="$(echo "${KEY%%,*}" | tr -d '[:space:]')"
if [ -z "$KEY" ] && [ -n "${NANOVLLM_API_KEYS_FILE:-}" ]; then  # one key a line, blank lines and # comments skipped
  KEY="$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$NANOVLLM_API_KEYS_FILE")"  # no pipe to cut short: pipefail
fi
AUTH=()
[ -n "$KEY" ] && AUTH=(-H "authorization: Bearer $KEY")

fail() { echo "warm-up FAILED: $*" >&2; exit 1; }

# /ready answers 200 once the model is loaded (requests get 503 until then); a systemd unit's TimeoutStartSec must
# exceed WAIT_S
echo "waiting for $BASE/ready (up to ${WAIT_S}s)"
deadline=$((SECONDS + WAIT_S))
until curl -fsS "$BASE/ready" >/dev/null 2>&1; do
  [ "$SECONDS" -lt "$deadline" ] || fail "/ready never answered 200"
  sleep 1
done

post() {  # post PATH JSON -> body on stdout; fails on a non-2xx status
  curl -fsS -X POST "$BASE$1" ${AUTH[@]+"${AUTH[@]}"} -H 'content-type: application/json' --data-binary @- <<<"$2"
}

echo "zero-shot warm-up"
post /generate_blocking '{"target_text": "Warm-up.", "max_generate_length": 4}' >/dev/null || fail "zero-shot"

echo "HiFi warm-up"
# a tone of its own each run: voice ids are content hashes, and replicas sharing a voice store warm up at once (one's
# delete would take the voice from under the other)
CLIP=$("$PY" - <<'PYEOF'
import base64, io, math, random, struct, wave
sr, hz = 16000, random.uniform(150, 250)
buf = io.BytesIO()
with wave.open(buf, "wb") as w:
    w.setnchannels(1); w.setsampwidth(2); w.setframerate(sr)
    w.writeframes(b"".join(struct.pack("<h", int(9000 * math.sin(2 * math.pi * hz * i / sr))) for i in range(sr)))
print(base64.b64encode(buf.getvalue()).decode())
PYEOF
)
HIFI=$(post /add_hifi "{\"wav_base64\": \"$CLIP\", \"wav_format\": \"wav\", \"prompt_text\": \"A warm-up tone.\"}") \
  || fail "add_hifi"
HIFI_ID=$("$PY" -c 'import json,sys; print(json.load(sys.stdin)["hifi_id"])' <<<"$HIFI")
post /generate_blocking "{\"target_text\": \"Warm-up.\", \"hifi_id\": \"$HIFI_ID\", \"max_generate_length\": 4}" \
  >/dev/null || fail "generate with hifi_id"
curl -fsS -X DELETE ${AUTH[@]+"${AUTH[@]}"} "$BASE/hifi/$HIFI_ID" >/dev/null || fail "delete hifi"
echo "warm-up OK"
