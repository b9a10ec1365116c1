"""Text tokenizer reproducing the official VoxCPM text ids without importing transformers or voxcpm.

Official semantics (what ``voxcpm`` does on top of ``LlamaTokenizerFast.from_pretrained``):

1. ``tokens = tokenizer.tokenize(text)`` -- no BOS/EOS;
2. every token whose text without ``"▁"`` is a vocab entry made of >= 2 CJK ideographs
   (U+4E00..U+9FFF) is replaced by its single characters (the ``"▁"`` is dropped);
3. ``ids = convert_tokens_to_ids(tokens)`` -- unknown strings map to the unk id.

Step 1 is reproduced by rebuilding the backend exactly the way transformers 5's ``LlamaTokenizer``
does from a checkpoint: only the BPE vocab and merges of ``tokenizer.json`` are kept; the pipeline is
forced to "no normalizer + ``Metaspace('▁', split=False)`` + BPE(byte_fallback, fuse_unk)", and the
added/special tokens are re-registered from ``tokenizer_config.json`` (or, without an
``added_tokens_decoder`` there, from ``tokenizer.json`` + ``special_tokens_map.json``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Encoding, Tokenizer, models, pre_tokenizers

__all__ = ["TextTokenizer", "normalize_text", "text_tokens", "text_tokens_many"]

_TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_MAP_FILE = "special_tokens_map.json"
_METASPACE = "▁"
# Named special-token attributes in the order transformers registers them.
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# LlamaTokenizer's constructor defaults.
_LLAMA_DEFAULTS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def normalize_text(text: str) -> str:
    """Line breaks and runs of white space become one space, as the official front end does
    (`re.sub(r"\\s+", " ", text.replace("\\n", " "))`): in C rather than by the regex engine, ~5x faster. `str.split`
    splits at the characters regex's `\\s` matches (every code point checked in the tests)."""
    body = " ".join(text.split())
    if not body:
        return " " if text else ""
    return (" " if text[0].isspace() else "") + body + (" " if text[-1].isspace() else "")


def text_tokens(tokenizer: TextTokenizer, target_text: str, prompt_text: str,
                continuation: bool) -> tuple[list[int], list[int] | None]:
    """A request's text ids as the official front end makes them: the normalised target text's (whose count caps the
    generation) and, for a continuation prompt, the transcript's and the target's together (what the model reads)."""
    ids = text_tokens_many(tokenizer, [(target_text, prompt_text, continuation)])[0]
    if isinstance(ids, Exception):
        raise ids
    return ids


def text_tokens_many(tokenizer: TextTokenizer, requests: list[tuple[str, str, bool]],
                     ) -> list[tuple[list[int], list[int] | None] | ValueError | TypeError]:
    """`text_tokens` of several requests (target text, prompt text, continuation) in one call into the backend; a
    request whose text cannot be encoded gets its error in its place (`TextTokenizer.encode_many`)."""
    texts: list[str] = []
    for target_text, prompt_text, continuation in requests:
        target = normalize_text(target_text)
        texts += [target, prompt_text + target] if continuation else [target]
    ids = iter(tokenizer.encode_many(texts))
    out: list[tuple[list[int], list[int] | None] | ValueError | TypeError] = []
    for _, _, continuation in requests:
        target_ids, both = next(ids), next(ids) if continuation else None
        error = next((x for x in (target_ids, both) if isinstance(x, Exception)), None)
        out.append(error if error is not None else (target_ids, both))
    return out


def _is_cjk_multichar(piece: str) -> bool:
    return len(piece) >= 2 and all("\u4e00" <= ch <= "\u9fff" for ch in piece)


def _read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


def _is_added_token_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("__type") == "AddedToken"


def _as_added_token(entry: Mapping[str, Any], *, force_special: bool | None = None) -> AddedToken:
    """Build an AddedToken from a serialized entry (``tokenizer.json`` / ``tokenizer_config.json``)."""
    if "content" not in entry:
        raise ValueError(f"malformed added-token entry in tokenizer files: {entry!r}")
    fields = {k: entry[k] for k in _ADDED_TOKEN_FIELDS if k in entry}
    if force_special is not None:
        fields["special"] = force_special
    return AddedToken(**fields)


def _special_value(value: Any) -> AddedToken | str | None:
    """Named special tokens are written as plain strings or AddedToken-like dicts."""
    if value is None or isinstance(value, (str, AddedToken)):
        return value
    if isinstance(value, Mapping):
        return _as_added_token(value)
    raise ValueError(f"unsupported special token entry in tokenizer config: {value!r}")


class TextTokenizer:
    """Thread-safe text -> id encoder for VoxCPM checkpoints.

    Immutable after construction: ``tokenizers.Tokenizer.encode`` only reads the backend, and the
    lookup tables are plain dicts/sets that are never mutated, so concurrent ``encode`` calls are safe.
    """

    def __init__(self, backend: Tokenizer, unk_token: str | None, source: str = "<memory>") -> None:
        self._backend = backend
        self._source = source
        # Full string -> id table (model vocab + added tokens), i.e. what convert_tokens_to_ids consults.
        self._vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        self._unk_id: int | None = self._vocab.get(unk_token) if unk_token is not None else None
        # Precomputed once: the set of multi-character pure-CJK vocab entries that get split.
        self._cjk_multichar: frozenset[str] = frozenset(p for p in self._vocab if _is_cjk_multichar(p))
        # Every vocab string the split applies to (with or without the "▁" marker): a text with none of
        # them (most text) maps piece by piece, without the per-piece marker strip.
        self._split_pieces: frozenset[str] = frozenset(
            p for p in self._vocab if p.replace(_METASPACE, "") in self._cjk_multichar)
        self._split_ids: frozenset[int] = frozenset(self._vocab[p] for p in self._split_pieces)
        self._vocab_size = max(self._vocab.values()) + 1 if self._vocab else 0

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        """Load the tokenizer files of a checkpoint directory (official layout)."""
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"tokenizer directory does not exist: {root}")
        tok_file = root / _TOKENIZER_FILE
        if not tok_file.is_file():
            present = sorted(p.name for p in root.iterdir() if p.name.startswith(("tokenizer", "special_")))
            hint = f" (found only {present}; sentencepiece-only layouts are unsupported)" if present else ""
            raise FileNotFoundError(f"no {_TOKENIZER_FILE} in tokenizer directory {root}{hint}")

        spec = _read_json(tok_file)
        config: dict[str, Any] = _read_json(root / _CONFIG_FILE) if (root / _CONFIG_FILE).is_file() else {}
        special_map: dict[str, Any] = (
            _read_json(root / _SPECIAL_MAP_FILE) if (root / _SPECIAL_MAP_FILE).is_file() else {}
        )
        model = spec.get("model") or {}
        if model.get("type", "BPE") != "BPE" or "vocab" not in model:
            raise ValueError(f"{tok_file}: expected a BPE tokenizer model, got type {model.get('type')!r}")

        vocab = model["vocab"]
        if isinstance(vocab, list):
            vocab = {(item[0] if isinstance(item, list) else item): i for i, item in enumerate(vocab)}
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]

        # transformers 5 discards the file's normalizer/pre-tokenizer and the model's unk_token and uses this.
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
        backend = Tokenizer(bpe)
        backend.normalizer = None
        # LlamaTokenizer: add_prefix_space defaults to True; legacy=True prepends "▁" to every segment
        # between added tokens, legacy=False only to the start of the text.
        add_prefix_space = config.get("add_prefix_space")
        if add_prefix_space is None or add_prefix_space:
            scheme = "always" if config.get("legacy", False) else "first"
        else:
            scheme = "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_METASPACE, prepend_scheme=scheme, split=False
        )

        unk = cls._register_added_tokens(backend, spec, config, special_map)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        backend.no_truncation()
        backend.no_padding()
        return cls(backend, unk, source=str(root))

    @staticmethod
    def _register_added_tokens(
        backend: Tokenizer, spec: dict[str, Any], config: dict[str, Any], special_map: dict[str, Any]
    ) -> str | None:
        """Register added/special tokens the way transformers 5 does; returns the unk token string.

        Order matters: a token missing from the BPE vocab gets the next free id in registration order.
        """
        cfg = dict(config)
        if "added_tokens_decoder" in cfg:
            # Modern layout (written by transformers >= 4.34): special_tokens_map.json is ignored.
            decoder = {int(i): _as_added_token(e) for i, e in cfg["added_tokens_decoder"].items()}
        else:
            # Legacy layout: special_tokens_map.json overrides the config, tokenizer.json lists added tokens.
            for key, value in special_map.items():
                if isinstance(value, list):
                    cfg[key] = [
                        _as_added_token(v, force_special=True) if isinstance(v, Mapping) else v for v in value
                    ]
                elif isinstance(value, Mapping):
                    cfg[key] = _as_added_token(value, force_special=True)
                else:
                    cfg[key] = value
            decoder = {int(e["id"]): _as_added_token(e) for e in spec.get("added_tokens") or []}

        named = {k: _special_value(cfg.get(k, _LLAMA_DEFAULTS.get(k))) for k in _NAMED_SPECIALS}
        # Any other "*_token" string/AddedToken entry becomes a model-specific special token.
        for key, value in cfg.items():
            if key not in named and key.endswith("_token"):
                token = _special_value(value) if _is_added_token_dict(value) else value
                if isinstance(token, (str, AddedToken)):
                    named[key] = token
        extras = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        if isinstance(extras, Mapping):
            named.update({k: _special_value(v) for k, v in extras.items()})
            extras = []

        to_add: list[AddedToken | str] = [tok for _, tok in sorted(decoder.items())]
        seen = {str(t) for t in to_add}
        for value in [*named.values(), *(_special_value(v) for v in extras)]:
            if value is not None and str(value) not in seen:
                seen.add(str(value))
                to_add.append(value)

        named_strings = {str(v) for v in named.values() if v is not None}
        tokens: list[AddedToken] = []
        for tok in to_add:
            if isinstance(tok, str):
                tok = AddedToken(tok, special=True)
            elif not tok.special and tok.content in named_strings:
                tok = AddedToken(
                    tok.content,
                    single_word=tok.single_word,
                    lstrip=tok.lstrip,
                    rstrip=tok.rstrip,
                    normalized=tok.normalized,
                    special=True,
                )
            tokens.append(tok)
        if tokens:
            backend.add_tokens(tokens)
        unk = named.get("unk_token")
        return str(unk) if unk is not None else None

    # ------------------------------------------------------------------ encoding
    @property
    def vocab_size(self) -> int:
        """Rows an embedding table needs to index every id this tokenizer can emit (max id + 1)."""
        return self._vocab_size

    @property
    def unk_id(self) -> int | None:
        return self._unk_id

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def tokenize(self, text: str) -> list[str]:
        """Backend pieces after the CJK multi-char split (the official ``CharTokenizerWrapper.tokenize``)."""
        if not isinstance(text, str):
            raise TypeError(f"expected str, got {type(text).__name__}")
        return self._split(self._backend.encode(text, add_special_tokens=False).tokens)

    def _split(self, backend_pieces: list[str]) -> list[str]:
        """The backend's pieces with every CJK multi-character piece split into its characters."""
        pieces: list[str] = []
        for piece in backend_pieces:
            bare = piece.replace(_METASPACE, "")
            if bare in self._cjk_multichar:
                pieces.extend(bare)  # split into characters; the "▁" marker is dropped like upstream
            else:
                pieces.append(piece)
        return pieces

    def encode(self, text: str) -> list[int]:
        """Official VoxCPM text ids for ``text`` (no BOS/EOS)."""
        ids = self.encode_many([text])[0]
        if isinstance(ids, Exception):
            raise ids
        return ids

    def encode_many(self, texts: list[str]) -> list[list[int] | ValueError | TypeError]:
        """`encode` of several texts in one call into the backend, which lets go of the GIL and spreads them over its
        threads; a text that cannot be encoded (a piece without an id: ValueError; what the backend refuses, such as a
        lone surrogate: TypeError) gets its error in its place, the others their ids."""
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"expected str, got {type(text).__name__}")
        try:
            encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        except TypeError:  # one text the backend refuses fails the batch: each alone then
            return [self._encode_one(text) for text in texts]
        return [self._encoding_ids(encoding) for encoding in encodings]

    def _encode_one(self, text: str) -> list[int] | ValueError | TypeError:
        try:
            encoding = self._backend.encode_batch([text], add_special_tokens=False)[0]
        except TypeError:
            return TypeError(f"the tokenizer cannot encode the text {text[:40]!r}...")
        return self._encoding_ids(encoding)

    def _encoding_ids(self, encoding: Encoding) -> list[int] | ValueError:
        """The ids of a backend encoding: the backend's own where no piece is split (each piece is then the vocab
        entry whose id the backend gives; the check on ids spares making the pieces' strings), else those of the
        split pieces."""
        ids = encoding.ids
        if self._split_ids.isdisjoint(ids):
            return ids
        try:
            return self._to_ids(self._split(encoding.tokens))
        except ValueError as e:
            return e

    def _to_ids(self, pieces: list[str]) -> list[int]:
        ids: list[int] = []
        for piece in pieces:
            idx = self._vocab.get(piece, self._unk_id)
            if idx is None:  # upstream would hand None to torch; fail loudly instead
                raise ValueError(f"token {piece!r} is not in the vocabulary of {self._source} (no unk token)")
            ids.append(idx)
        return ids

    def __repr__(self) -> str:
        return f"TextTokenizer(source={self._source!r}, vocab_size={self._vocab_size})"
