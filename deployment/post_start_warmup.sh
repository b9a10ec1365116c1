#!/usr/bin/env bash
# Post-start warm-up for a voxcpm-serve instance: waits for /health, then runs a zero-shot and a HiFi
# warm-up (add_hifi, generate with it, delete it) once /ready says the model is loaded. Exits non-zero if any step fails.
# Usage: deployment/post_start_warmup.sh [BASE_URL]   (default $VOXCPM_URL, else http://127.0.0.1:8000; WAIT_S=600 seconds
# for /health; PYTHON=python3 parses the answers)
set -euo pipefail
BASE="${1:-${VOXCPM_URL:-http://127.0.0.1:8000}}"
WAIT_S="${WAIT_S:-600}"
PY="${PYTHON:-python3}"

fail() { echo "warm-up FAILED: $*" >&2; exit 1; }

echo "waiting for $BASE/health (up to ${WAIT_S}s)"
for _ in $(seq "$WAIT_S"); do
  curl -fsS "$BASE/health" >/dev/null 2>&1 && break
  sleep 1
done
curl -fsS "$BASE/health" >/dev/null || fail "/health never answered"
# the service answers /health while the model loads; requests get 503 until /ready
for _ in $(seq "$WAIT_S"); do
  curl -fsS "$BASE/ready" >/dev/null 2>&1 && break
  sleep 1
done
curl -fsS "$BASE/ready" >/dev/null || fail "/ready never answered 200"

post() {  # post PATH JSON -> body on stdout; fails on a non-2xx status
  curl -fsS -X POST "$BASE$1" -H 'content-type: application/json' --data-binary @- <<<"$2"
}

echo "zero-shot warm-up"
post /generate_blocking '{"target_text": "Warm-up.", "max_generate_length": 4}' >/dev/null || fail "zero-shot"

echo "HiFi warm-up"
CLIP=$("$PY" - <<'PYEOF'
import base64, io, math, struct, wave
sr = 16000
buf = io.BytesIO()
with wave.open(buf, "wb") as w:
    w.setnchannels(1); w.setsampwidth(2); w.setframerate(sr)
    w.writeframes(b"".join(struct.pack("<h", int(9000 * math.sin(2 * math.pi * 180 * i / sr))) for i in range(sr)))
print(base64.b64encode(buf.getvalue()).decode())
PYEOF
)
HIFI=$(post /add_hifi "{\"wav_base64\": \"$CLIP\", \"wav_format\": \"wav\", \"prompt_text\": \"A warm-up tone.\"}") \
  || fail "add_hifi"
HIFI_ID=$("$PY" -c 'import json,sys; print(json.load(sys.stdin)["hifi_id"])' <<<"$HIFI")
post /generate_blocking "{\"target_text\": \"Warm-up.\", \"hifi_id\": \"$HIFI_ID\", \"max_generate_length\": 4}" \
  >/dev/null || fail "generate with hifi_id"
curl -fsS -X DELETE "$BASE/hifi/$HIFI_ID" >/dev/null || fail "delete hifi"
echo "warm-up OK"
