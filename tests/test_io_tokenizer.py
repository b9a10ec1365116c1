"""Parity of engine.io.tokenizer.TextTokenizer with the official VoxCPM text tokenization.

The oracle is ``voxcpm.model.utils.mask_multichar_chinese_tokens`` wrapped around
``transformers.LlamaTokenizerFast.from_pretrained`` -- exactly what ``voxcpm`` does when it loads a model.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from engine.io.tokenizer import TextTokenizer, normalize_text, text_tokens, text_tokens_many
from engine.io.tokenizer_builder import build_tokenizer

transformers = pytest.importorskip("transformers")
voxcpm_utils = pytest.importorskip("voxcpm.model.utils")

AUDIO_SPECIAL_IDS = (101, 102, 103, 104)

ENGLISH = "The quick brown fox jumps over the lazy dog. Speech synthesis is fun!"
CHINESE = "今天天气很好，我们一起去公园散步吧。语音合成技术可以把文字转换成自然的声音。"
MIXED = "我们使用 PyTorch 训练了一个 TTS 模型，延迟大约是 120 毫秒。Hello 大家好！"
DIGITS_PUNCT = "On 2024-03-15 at 09:30, the price was $25.50 (down 3.7%); call +1 555-0100 #42?!"
SPACES = "   leading and trailing spaces   "
VOICE_PREFIX = "(温柔的女声，语速稍慢) 你好，欢迎收听今天的新闻。"
# Characters absent from the embedded corpus: must go through byte fallback.
UNSEEN = "Ünïcödé ẞ ñ 😀🎉 ☃ 日本語のテキスト 한국어 Ωμέγα ₿ 龘"

PARITY_TEXTS = {
    "english": ENGLISH,
    "chinese": CHINESE,
    "mixed": MIXED,
    "digits_punct": DIGITS_PUNCT,
    "spaces": SPACES,
    "single_leading_space_zh": " 你好 世界 ",
    "voice_prefix": VOICE_PREFIX,
    "voice_prefix_en": "(a calm, deep male voice) Good evening, here is the news.",
    "unseen_chars": UNSEEN,
    "empty": "",
    "only_space": " ",
    "whitespace_mix": "line one\nline two\t\ttabbed\r\n  indented",
    "fullwidth": "全角　空格，ＡＢＣ１２３！",
    "literal_metaspace": "▁我们▁ ▁",
    "literal_specials": "a<s>b</s>c<unk>d <|audio_start|>你好<|audio_end|>",
}


def _official(path: Path) -> tuple[Any, Any]:
    hf = transformers.LlamaTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return hf, voxcpm_utils.mask_multichar_chinese_tokens(hf)


def _is_cjk_multichar(piece: str) -> bool:
    bare = piece.replace("▁", "")
    return len(bare) >= 2 and all("\u4e00" <= c <= "\u9fff" for c in bare)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out, vocab_size=2048, seed=0)
    return out


@pytest.fixture(scope="module")
def ours(tok_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def official(tok_dir: Path) -> tuple[Any, Any]:
    return _official(tok_dir)


# --------------------------------------------------------------------------- parity
@pytest.mark.parametrize("text", list(PARITY_TEXTS.values()), ids=list(PARITY_TEXTS))
def test_ids_match_official(text: str, ours: TextTokenizer, official: tuple[Any, Any]) -> None:
    _, wrapped = official
    expected = wrapped(text)
    assert ours.encode(text) == expected
    assert ours.tokenize(text) == wrapped.tokenize(text)
    assert all(0 <= i < ours.vocab_size for i in expected)


def test_random_texts_match_official(ours: TextTokenizer, official: tuple[Any, Any]) -> None:
    _, wrapped = official
    rng = random.Random(1234)
    alphabet = list(ENGLISH + CHINESE + MIXED + DIGITS_PUNCT + VOICE_PREFIX + UNSEEN) + [" ", "  ", "\n"]
    words = re.findall(r"\S+", f"{ENGLISH} {MIXED} {VOICE_PREFIX}") + ["我们", "今天", "语音合成"]
    for _ in range(300):
        n = rng.randint(0, 12)
        parts = [rng.choice(words) if rng.random() < 0.5 else rng.choice(alphabet) for _ in range(n)]
        text = rng.choice(["", " "]).join(parts)
        assert ours.encode(text) == wrapped(text), repr(text)


def test_cjk_multichar_split_is_exercised(ours: TextTokenizer, official: tuple[Any, Any]) -> None:
    hf, wrapped = official
    raw = hf.tokenize(CHINESE)
    multichar = [p for p in raw if _is_cjk_multichar(p) and p.replace("▁", "") in hf.get_vocab()]
    assert multichar, f"no multi-char CJK piece in raw tokenization: {raw}"
    # The split really changes the ids: raw ids are shorter than the official (split) ids.
    assert len(hf.convert_tokens_to_ids(raw)) < len(wrapped(CHINESE)) == len(ours.encode(CHINESE))
    # After the split no multi-char CJK vocab piece survives.
    assert not any(p.replace("▁", "") in ours._cjk_multichar for p in ours.tokenize(CHINESE))


def test_byte_fallback_is_exercised(ours: TextTokenizer, official: tuple[Any, Any]) -> None:
    hf, _ = official
    pieces = ours.tokenize(UNSEEN)
    assert any(re.fullmatch(r"<0x[0-9A-F]{2}>", p) for p in pieces), pieces
    assert ours.unk_id not in ours.encode(UNSEEN)
    assert hf.tokenize(UNSEEN) == pieces


def test_special_ids_and_vocab_size(ours: TextTokenizer, official: tuple[Any, Any]) -> None:
    hf, _ = official
    assert ours.vocab_size == len(hf) <= 2048
    for idx in (0, 1, 2, *AUDIO_SPECIAL_IDS):
        assert idx < ours.vocab_size
        assert hf.convert_ids_to_tokens(idx) is not None
    assert ours.token_to_id("<unk>") == 0 and ours.token_to_id("<s>") == 1 and ours.token_to_id("</s>") == 2
    assert ours.encode("Hello")[0] not in (1, 2)  # no BOS/EOS


def test_thread_safe(ours: TextTokenizer) -> None:
    texts = list(PARITY_TEXTS.values()) * 40
    expected = [ours.encode(t) for t in texts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(ours.encode, texts))
    assert got == expected


# --------------------------------------------------------------------------- other checkpoint layouts
def _edit(name: str, fn: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        data = json.loads((d / name).read_text(encoding="utf-8"))
        fn(data)
        (d / name).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")

    return apply


def _spm_style_pipeline(tok: dict[str, Any]) -> None:
    # Layout of converted sentencepiece tokenizers: Prepend/Replace normalizer, no pre-tokenizer.
    tok["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    tok["pre_tokenizer"] = None


def _added_beyond_vocab(tok: dict[str, Any]) -> None:
    tok["added_tokens"].append(
        {
            "id": len(tok["model"]["vocab"]) + 7,
            "content": "<|im_start|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )


def _drop_decoder(cfg: dict[str, Any]) -> None:
    cfg.pop("added_tokens_decoder")


def _legacy_true(cfg: dict[str, Any]) -> None:
    cfg["legacy"] = True


def _extra_specials(cfg: dict[str, Any]) -> None:
    cfg["pad_token"] = "<|pad|>"
    cfg["bos_token"] = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": True,
                        "rstrip": False, "single_word": False}  # fmt: skip


VARIANTS: dict[str, list[Callable[[Path], None]]] = {
    "legacy_true": [_edit("tokenizer_config.json", _legacy_true)],
    "spm_style_pipeline": [_edit("tokenizer.json", _spm_style_pipeline)],
    "no_added_tokens_decoder": [_edit("tokenizer_config.json", _drop_decoder)],
    "added_token_beyond_vocab": [
        _edit("tokenizer_config.json", _drop_decoder),
        _edit("tokenizer.json", _added_beyond_vocab),
    ],
    "extra_named_specials": [_edit("tokenizer_config.json", _extra_specials)],
    "tokenizer_json_only": [
        lambda d: (d / "tokenizer_config.json").unlink(),
        lambda d: (d / "special_tokens_map.json").unlink(),
    ],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_layout_variants(variant: str, tok_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / variant
    shutil.copytree(tok_dir, d)
    for edit in VARIANTS[variant]:
        edit(d)
    hf, wrapped = _official(d)
    ours = TextTokenizer.from_dir(d)
    assert ours.vocab_size == len(hf)
    for text in [*PARITY_TEXTS.values(), "x<|im_start|>y<|pad|>z"]:
        assert ours.encode(text) == wrapped(text), (variant, text)


# --------------------------------------------------------------------------- builder
def test_builder_deterministic_and_seeded(tmp_path: Path) -> None:
    files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    build_tokenizer(tmp_path / "a", vocab_size=1500, seed=3)
    build_tokenizer(tmp_path / "b", vocab_size=1500, seed=3)
    build_tokenizer(tmp_path / "c", vocab_size=1500, seed=4)
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    a, c = ((tmp_path / sub / "tokenizer.json").read_bytes() for sub in ("a", "c"))
    assert a != c


@pytest.mark.parametrize("vocab_size", [1000, 4096, 73448])
def test_builder_respects_vocab_size(vocab_size: int, tmp_path: Path) -> None:
    build_tokenizer(tmp_path, vocab_size=vocab_size)
    tok = TextTokenizer.from_dir(tmp_path)
    assert max(AUDIO_SPECIAL_IDS) < tok.vocab_size <= vocab_size
    if vocab_size == 1000:
        assert tok.vocab_size == vocab_size  # small sizes are filled exactly
    assert any(_is_cjk_multichar(p) for p in tok._vocab)
    _, wrapped = _official(tmp_path)
    for text in (CHINESE, MIXED, UNSEEN):
        assert tok.encode(text) == wrapped(text)


def test_builder_rejects_tiny_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size=300)


# --------------------------------------------------------------------------- errors
def test_missing_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        TextTokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        TextTokenizer.from_dir(tmp_path / "does-not-exist")


def test_rejects_non_str(ours: TextTokenizer) -> None:
    with pytest.raises(TypeError):
        ours.encode(b"bytes")  # type: ignore[arg-type]


def test_encode_many_gives_each_text_its_own_ids_and_a_refused_one_its_error(ours: TextTokenizer) -> None:
    """Several texts in one backend call give the ids each has alone; a text the backend refuses (a lone surrogate)
    gets a TypeError in its place, a request of a continuation prompt whose transcript holds it too, the others
    their ids; `encode` and `text_tokens` raise it."""
    texts = [ENGLISH, CHINESE, MIXED, UNSEEN]
    assert ours.encode_many(texts) == [ours.encode(t) for t in texts]
    bad = "A lone \ud800 surrogate."
    out = ours.encode_many([ENGLISH, bad, CHINESE])
    assert out[0] == ours.encode(ENGLISH) and out[2] == ours.encode(CHINESE) and isinstance(out[1], TypeError)
    many = text_tokens_many(ours, [(ENGLISH, "", False), ("Target.", bad, True), (MIXED, "A prompt.", True)])
    assert many[0] == text_tokens(ours, ENGLISH, "", False) and isinstance(many[1], TypeError)
    assert many[2] == text_tokens(ours, MIXED, "A prompt.", True)
    with pytest.raises(TypeError):
        ours.encode(bad)
    with pytest.raises(TypeError):
        text_tokens(ours, bad, "", False)


def test_normalize_text_is_the_official_substitution() -> None:
    """`normalize_text` gives what the official front end's regex does: `str.split` splits at exactly the code points
    regex's \\s matches, and texts of words, runs of mixed (Unicode too) white space and white space at the edges
    agree."""
    official = re.compile(r"\s+")
    every = "".join(map(chr, range(0x110000)))
    spaces = {c for c in every if c.isspace()}
    assert set(re.findall(r"\s", every)) == spaces
    assert "".join(every.split()) == "".join(c for c in every if c not in spaces)
    rng = random.Random(0)
    parts = ["word", "中文", "é", " ", "  ", "\n", "\t", "\r\n", "\u00a0", "\u3000", "\u2028", "\x1c", "\x85", "."]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 10)))
        assert normalize_text(text) == official.sub(" ", text.replace("\n", " ")), repr(text)
