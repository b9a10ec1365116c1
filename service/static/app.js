// The playground: calls the service's public API (relative URLs, so it works behind a path prefix) with the key the
// user types, plays the audio while it streams (MP3 through Media Source Extensions, PCM through Web Audio), draws
// the waveform of what has arrived, and reports the request's TTFB and RTF. window.playground holds the last
// request's state for anyone watching (the browser test reads it).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "voxcpm-serve.api-key";
const state = (window.playground = { phase: "idle" });
let current = null; // the running request: {controller, sink}
let downloadUrl = null;

function headers(json) {
  const h = json ? { "Content-Type": "application/json" } : {};
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorText(resp) {
  // The service's errors are {"detail": "field: rule"} or FastAPI's list of {loc, msg}.
  try {
    const body = await resp.json();
    const detail = body.detail ?? body.error?.message ?? body;
    if (Array.isArray(detail)) return detail.map((d) => `${(d.loc || []).slice(1).join(".")}: ${d.msg}`).join("; ");
    return typeof detail === "string" ? detail : JSON.stringify(detail);
  } catch {
    return resp.statusText;
  }
}

async function api(path, body) {
  const resp = await fetch(path, body === undefined ? { headers: headers(false) }
    : { method: "POST", headers: headers(true), body: JSON.stringify(body) });
  if (!resp.ok) throw new Error(`${path}: ${resp.status} ${await errorText(resp)}`);
  return resp.json();
}

function say(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function loadInfo() {
  try {
    const info = await api("info");
    const m = info.model;
    $("model").textContent = `${m.model_id} · ${m.sample_rate ?? "?"} Hz${m.random_weights ? " · random weights" : ""}`;
  } catch (e) {
    $("model").textContent = e.message.includes(" 401 ") ? "API key needed" : e.message;
  }
}

async function loadVoices(select) {
  const picker = $("voice");
  const kinds = [["hifi", "hifi", "HiFi"], ["prompts", "prompt", "Prompt"], ["references", "reference", "Reference"]];
  try {
    const lists = await Promise.all(kinds.map(([path]) => api(path)));
    picker.replaceChildren(new Option("default (zero-shot)", ""));
    lists.forEach((list, i) => {
      if (!list.voices.length) return;
      const group = document.createElement("optgroup");
      group.label = kinds[i][2];
      for (const v of list.voices) {
        const text = v.prompt_text ? ` · ${v.prompt_text.slice(0, 40)}` : "";
        group.append(new Option(`${v.id.slice(0, 12)}${text}`, `${kinds[i][1]}:${v.id}`));
      }
      picker.append(group);
    });
    if (select) picker.value = select;
    state.voices = [...picker.options].map((o) => o.value).filter(Boolean);
  } catch (e) {
    say(e.message, true);
  }
}

function base64Of(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1]);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function upload() {
  const file = $("clip").files[0];
  if (!file) return say("Choose an audio clip first.", true);
  const transcript = $("transcript").value.trim();
  const body = { wav_base64: await base64Of(file), wav_format: (file.name.split(".").pop() || "wav").toLowerCase() };
  if (transcript) body.prompt_text = transcript;
  say("Uploading " + file.name + "…");
  try {
    const made = await api(transcript ? "add_hifi" : "add_reference", body);
    const value = transcript ? `hifi:${made.hifi_id}` : `reference:${made.reference_id}`;
    state.uploaded = value;
    await loadVoices(value);
    say(`Added ${transcript ? "HiFi" : "reference"} voice ${value.split(":")[1]}.`);
  } catch (e) {
    say(e.message, true);
  }
}

function requestBody() {
  const design = $("design").value.trim();
  const text = $("text").value;
  const body = { target_text: design ? `(${design})${text}` : text, response_format: $("format").value };
  const [kind, id] = $("voice").value.split(":");
  if (id) body[{ hifi: "hifi_id", prompt: "prompt_id", reference: "ref_audio_id" }[kind]] = id;
  const numbers = { "max-length": "max_generate_length", temperature: "temperature", cfg: "cfg_value", seed: "seed" };
  for (const [input, field] of Object.entries(numbers)) {
    if ($(input).value !== "") body[field] = Number($(input).value);
  }
  return body;
}

// --- waveform -------------------------------------------------------------------------------------------------

class Waveform {
  constructor(canvas) {
    this.canvas = canvas;
    this.peaks = []; // [min, max] per 10 ms of audio
    this.rate = 48000;
    this.position = 0; // seconds played
  }

  reset(rate) {
    this.peaks = [];
    this.rate = rate;
    this.position = 0;
    this.draw();
  }

  setSamples(samples, from = 0) {
    // replaces the peaks from sample `from` on (PCM appends; a re-decoded MP3 replaces them all)
    const step = Math.max(1, Math.round(this.rate / 100));
    this.peaks.length = Math.floor(from / step);
    for (let i = 0; i < samples.length; i += step) {
      let lo = 1, hi = -1;
      for (let j = i; j < Math.min(i + step, samples.length); j++) {
        lo = Math.min(lo, samples[j]);
        hi = Math.max(hi, samples[j]);
      }
      this.peaks.push([lo, hi]);
    }
    this.draw();
  }

  draw() {
    const { canvas, peaks } = this;
    const g = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height;
    g.fillStyle = "#101418";
    g.fillRect(0, 0, w, h);
    const columns = Math.max(peaks.length, 10 * 100); // at least 10 s wide, so a short clip is not stretched
    g.fillStyle = "#4fc3f7";
    for (let x = 0; x < w; x++) {
      const a = Math.floor((x * columns) / w), b = Math.floor(((x + 1) * columns) / w);
      if (a >= peaks.length) break;
      let lo = 1, hi = -1;
      for (let i = a; i < Math.max(b, a + 1) && i < peaks.length; i++) {
        lo = Math.min(lo, peaks[i][0]);
        hi = Math.max(hi, peaks[i][1]);
      }
      const y0 = ((1 - hi) / 2) * h, y1 = ((1 - lo) / 2) * h;
      g.fillRect(x, y0, 1, Math.max(1, y1 - y0));
    }
    if (this.position > 0) {
      g.fillStyle = "#ffb300";
      g.fillRect(Math.min(w - 1, (this.position * 100 * w) / columns), 0, 2, h);
    }
  }
}

// --- sinks: play the bytes as they arrive ---------------------------------------------------------------------

function playing() {
  if (state.playbackStarted) return;
  state.playbackStarted = true;
  state.playbackStartedMs = performance.now() - state.startedAt; // against streamEndedMs: did it play while streaming
}

class PcmSink {
  // s16le mono through Web Audio: each chunk becomes a buffer scheduled right after the previous one.
  constructor(ctx, rate, wave) {
    this.ctx = ctx;
    this.rate = rate;
    this.wave = wave;
    this.carry = new Uint8Array(0); // an odd byte left from the last chunk
    this.samples = 0;
    this.next = 0;
    this.firstStart = null;
    this.sources = new Set();
    this.finished = false;
  }

  push(bytes) {
    const all = new Uint8Array(this.carry.length + bytes.length);
    all.set(this.carry);
    all.set(bytes, this.carry.length);
    const n = all.length >> 1;
    this.carry = all.slice(2 * n);
    if (!n) return;
    const ints = new Int16Array(all.buffer.slice(0, 2 * n));
    const floats = Float32Array.from(ints, (s) => s / 32768);
    this.wave.setSamples(floats, this.samples);
    this.samples += n;
    const buffer = this.ctx.createBuffer(1, n, this.rate);
    buffer.copyToChannel(floats, 0);
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    this.next = Math.max(this.next, this.ctx.currentTime + 0.05); // the first chunk, or after an underrun
    if (this.firstStart === null) this.firstStart = this.next;
    source.start(this.next);
    this.next += n / this.rate;
    this.sources.add(source);
    source.onended = () => {
      this.sources.delete(source);
      this.settle();
    };
  }

  end() {
    this.finished = true;
    this.settle();
  }

  settle() {
    if (this.finished && this.sources.size === 0) state.playbackEnded = true;
  }

  tick() {
    if (this.firstStart !== null && this.ctx.state === "running" && this.ctx.currentTime >= this.firstStart) {
      playing();
      this.wave.position = Math.min(this.ctx.currentTime - this.firstStart, this.seconds());
    }
  }

  seconds() {
    return this.samples / this.rate;
  }

  stop() {
    for (const source of this.sources) source.stop();
  }
}

class Mp3Sink {
  // MP3 frames through Media Source Extensions into the <audio> element (which plays from the first frames); the
  // waveform comes from decoding what has arrived, at most a few times a second.
  constructor(player, ctx, wave) {
    this.player = player;
    this.ctx = ctx;
    this.wave = wave;
    this.chunks = [];
    this.queue = [];
    this.finished = false;
    this.decoding = false;
    this.decodedAt = 0;
    this.decodedSeconds = 0;
    this.media = new MediaSource();
    this.media.addEventListener("sourceopen", () => {
      this.buffer = this.media.addSourceBuffer("audio/mpeg");
      this.buffer.addEventListener("updateend", () => this.pump());
      this.pump();
    }, { once: true });
    player.src = URL.createObjectURL(this.media);
    player.onplaying = () => playing();
    player.onended = () => (state.playbackEnded = true);
    player.onerror = () => (state.playerError = player.error && player.error.message);
    player.play().catch((e) => (state.playerError = e.message));
  }

  push(bytes) {
    this.chunks.push(bytes);
    this.queue.push(bytes);
    this.pump();
    if (performance.now() - this.decodedAt > 300) this.decode();
  }

  pump() {
    if (!this.buffer || this.buffer.updating || this.media.readyState !== "open") return;
    if (this.queue.length) {
      const data = new Uint8Array(this.queue.reduce((n, c) => n + c.length, 0));
      let at = 0;
      for (const c of this.queue.splice(0)) {
        data.set(c, at);
        at += c.length;
      }
      this.buffer.appendBuffer(data);
    } else if (this.finished) {
      this.media.endOfStream();
    }
  }

  async decode() {
    if (this.decoding) return;
    this.decoding = true;
    this.decodedAt = performance.now();
    try {
      const bytes = await new Blob(this.chunks).arrayBuffer();
      const audio = await this.ctx.decodeAudioData(bytes);
      this.wave.rate = audio.sampleRate;
      this.wave.setSamples(audio.getChannelData(0));
      this.decodedSeconds = audio.duration;
    } catch {
      // a cut that no decoder takes yet: the next chunk's decode draws it
    } finally {
      this.decoding = false;
    }
  }

  async end() {
    this.finished = true;
    this.pump();
    while (this.decoding) await new Promise((r) => setTimeout(r, 20));
    await this.decode();
  }

  tick() {
    this.wave.position = this.player.currentTime;
  }

  seconds() {
    return this.decodedSeconds;
  }

  stop() {
    this.player.pause();
  }
}

// --- one generation -----------------------------------------------------------------------------------------

function wavHeader(bytes, rate) {
  const h = new DataView(new ArrayBuffer(44));
  const text = (at, s) => [...s].forEach((c, i) => h.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF"); h.setUint32(4, 36 + bytes, true); text(8, "WAVE"); text(12, "fmt ");
  h.setUint32(16, 16, true); h.setUint16(20, 1, true); h.setUint16(22, 1, true); h.setUint32(24, rate, true);
  h.setUint32(28, 2 * rate, true); h.setUint16(32, 2, true); h.setUint16(34, 16, true);
  text(36, "data"); h.setUint32(40, bytes, true);
  return h.buffer;
}

function offerDownload(chunks, format, rate) {
  if (downloadUrl) URL.revokeObjectURL(downloadUrl);
  const bytes = chunks.reduce((n, c) => n + c.length, 0);
  // PCM is saved as WAV (the same samples behind a 44-byte header) so that any player opens it
  const blob = format === "pcm" ? new Blob([wavHeader(bytes, rate), ...chunks], { type: "audio/wav" })
    : new Blob(chunks, { type: "audio/mpeg" });
  downloadUrl = URL.createObjectURL(blob);
  const link = $("download");
  link.href = downloadUrl;
  link.download = `speech.${format === "pcm" ? "wav" : "mp3"}`;
  link.textContent = `Download ${link.download} (${(blob.size / 1024).toFixed(1)} KiB)`;
  link.hidden = false;
}

function showStats() {
  $("ttfb").textContent = state.ttfbMs != null ? `${state.ttfbMs.toFixed(0)} ms` : "–";
  $("rtf").textContent = state.rtf != null ? state.rtf.toFixed(3) : "–";
  $("audio-seconds").textContent = state.audioSeconds != null ? `${state.audioSeconds.toFixed(2)} s` : "–";
  $("bytes").textContent = state.bytes ? `${(state.bytes / 1024).toFixed(1)} KiB` : "–";
}

const wave = new Waveform($("wave"));
let audioContext = null;

async function generate() {
  if (current) stop();
  // made and resumed inside the click, where browsers allow audio to start
  audioContext = audioContext || new AudioContext();
  audioContext.resume();
  const body = requestBody();
  $("player").hidden = body.response_format !== "mp3"; // PCM plays through Web Audio, not the element
  const controller = new AbortController();
  Object.assign(state, { phase: "requesting", request: body, bytes: 0, chunks: 0, ttfbMs: null, rtf: null,
    audioSeconds: null, playbackStarted: false, playbackEnded: false, playerError: null, error: null,
    playbackStartedMs: null, streamEndedMs: null });
  showStats();
  $("download").hidden = true;
  let sink = body.response_format === "mp3" ? new Mp3Sink($("player"), audioContext, wave) : null;
  const job = (current = { controller, sink });
  $("generate").disabled = true;
  $("stop").disabled = false;
  say("Generating…");
  const started = (state.startedAt = performance.now());
  try {
    const resp = await fetch("generate", { method: "POST", headers: headers(true), body: JSON.stringify(body),
      signal: controller.signal });
    if (!resp.ok) throw new Error(`generate: ${resp.status} ${await errorText(resp)}`);
    const rate = Number(resp.headers.get("X-Audio-Sample-Rate")) || 48000;
    wave.reset(rate);
    sink = job.sink = sink || new PcmSink(audioContext, rate, wave);
    const chunks = [];
    const reader = resp.body.getReader();
    state.phase = "streaming";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      if (state.ttfbMs === null) state.ttfbMs = performance.now() - started;
      chunks.push(value);
      state.bytes += value.length;
      state.chunks++;
      sink.push(value);
      showStats();
    }
    const wall = (performance.now() - started) / 1000;
    state.streamEndedMs = 1000 * wall;
    await sink.end();
    state.audioSeconds = sink.seconds();
    state.rtf = state.audioSeconds > 0 ? wall / state.audioSeconds : null;
    offerDownload(chunks, body.response_format, rate);
    state.phase = "done";
    say(`Done: ${state.audioSeconds.toFixed(2)} s of audio in ${wall.toFixed(2)} s.`);
  } catch (e) {
    state.phase = "error";
    state.error = e.name === "AbortError" ? "stopped" : e.message;
    say(state.error, e.name !== "AbortError");
  } finally {
    showStats();
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

function stop() {
  if (!current) return;
  current.controller.abort();
  if (current.sink) current.sink.stop();
  current = null;
}

setInterval(() => {
  if (current && current.sink) {
    current.sink.tick();
    wave.draw();
  }
}, 100);

$("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
  loadInfo();
  loadVoices();
});
$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", stop);
$("upload").addEventListener("click", upload);
$("refresh-voices").addEventListener("click", () => loadVoices($("voice").value));
wave.draw();
loadInfo();
loadVoices();
