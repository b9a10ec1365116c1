"""Build a small Llama-style byte-fallback BPE tokenizer for random-weight test checkpoints.

Real VoxCPM checkpoints ship a ~73k-piece sentencepiece-style BPE tokenizer (``tokenizer.json`` +
``tokenizer_config.json`` + ``special_tokens_map.json``). Tests and ``tools/make_random_checkpoint.py``
need a checkpoint directory with the same file layout and the same tokenization pipeline, without any
network access, so this module trains a tiny tokenizer with the ``tokenizers`` library on an embedded
bilingual corpus.

Layout of the produced vocabulary (ids are what the model's embedding table is indexed by):

* ``0`` ``<unk>``, ``1`` ``<s>``, ``2`` ``</s>``;
* ``3 .. 127`` reserved special tokens; ``101..104`` are the audio start/end and reference-audio start/end
  ids that the model emits/consumes directly;
* ``128 .. 383`` byte-fallback pieces ``<0x00> .. <0xFF>``;
* then the trained alphabet and merged pieces (including multi-character CJK pieces such as ``你好``).

The pipeline written to ``tokenizer.json`` (no normalizer, ``Metaspace("▁", prepend_scheme="first",
split=False)``, BPE with ``byte_fallback`` and ``fuse_unk``) is exactly what transformers 5's
``LlamaTokenizer`` rebuilds when it loads a checkpoint, so transformers 4, transformers 5 and
``engine.io.tokenizer.TextTokenizer`` all tokenize a generated checkpoint identically.

Vocabulary size: the result has at most ``vocab_size`` entries. A few-KB corpus cannot supply tens of
thousands of merges, so for large sizes (the full-size preset uses 73448) the tokenizer is smaller than
the model's embedding table; the extra embedding rows are simply never indexed by text tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "AUDIO_END_TOKEN",
    "AUDIO_START_TOKEN",
    "REF_AUDIO_END_TOKEN",
    "REF_AUDIO_START_TOKEN",
    "NUM_RESERVED_SPECIAL",
    "build_tokenizer",
]

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
# Named after their role; the model addresses them by id (101..104), never by text.
AUDIO_START_TOKEN = "<|audio_start|>"
AUDIO_END_TOKEN = "<|audio_end|>"
REF_AUDIO_START_TOKEN = "<|ref_audio_start|>"
REF_AUDIO_END_TOKEN = "<|ref_audio_end|>"
_NAMED_SPECIAL = {
    0: UNK,
    1: BOS,
    2: EOS,
    101: AUDIO_START_TOKEN,
    102: AUDIO_END_TOKEN,
    103: REF_AUDIO_START_TOKEN,
    104: REF_AUDIO_END_TOKEN,
}
# Ids 0..127 are special tokens, so 101..104 always exist regardless of the trained part.
NUM_RESERVED_SPECIAL = 128
_NUM_BYTES = 256
# Specials + byte pieces + room for at least the basic alphabet of the corpus.
_MIN_VOCAB = NUM_RESERVED_SPECIAL + _NUM_BYTES + 64

# Hand-written bilingual corpus. Chinese lines deliberately repeat common words so BPE learns
# multi-character CJK pieces (the path VoxCPM splits back into single characters).
_CORPUS_EN = """\
The quick brown fox jumps over the lazy dog.
Hello world, this is a text to speech system.
Speech synthesis turns written text into natural sounding audio.
The weather is nice today, so we are going for a walk in the park.
Please read the following sentence slowly and clearly.
She sells sea shells by the sea shore every summer morning.
A voice model can speak in many different styles and emotions.
We measured the latency of the streaming server at 120 milliseconds.
The meeting starts at 9:30 in the morning on Monday, March 3rd.
Can you tell me the way to the nearest train station, please?
Thank you very much for your help, I really appreciate it.
The new model was trained on thousands of hours of recorded speech.
Good morning everyone, welcome to the annual developer conference.
It was the best of times, it was the worst of times.
The temperature will drop to minus five degrees tonight.
Reading books every evening is a good habit for children.
He opened the window and listened to the sound of the rain.
Our engineers are improving the quality and the speed of the engine.
The price of the ticket is 25 dollars and 50 cents.
Music, art and language are the things that make us human.
The cat sat on the mat and looked at the bird outside.
Please remember to save your work before you close the program.
The river flows through the valley toward the distant sea.
Artificial intelligence is changing the way we work and live.
I would like a cup of coffee with milk and no sugar.
The train to London leaves from platform number seven.
"""

_CORPUS_ZH = """\
今天天气很好，我们一起去公园散步吧。
你好，欢迎使用语音合成系统。
语音合成技术可以把文字转换成自然的声音。
我们今天的会议在上午九点开始。
这个模型可以用不同的声音和情感说话。
请你慢慢地、清楚地读下面这句话。
中国是一个历史悠久的国家，有很多美丽的城市。
北京是中国的首都，上海是中国最大的城市。
我喜欢在晚上读书，也喜欢听音乐。
谢谢你的帮助，我真的非常感谢。
今天的天气预报说明天会下雨。
我们的工程师正在提高系统的速度和质量。
人工智能正在改变我们的工作和生活。
这本书讲的是一个关于朋友和家人的故事。
他打开窗户，听着外面下雨的声音。
请问去最近的火车站怎么走？
学习中文需要每天练习说话和写字。
我们的语音模型使用了大量的中文和英文数据。
时间过得真快，一年又要结束了。
大家早上好，欢迎来到今年的开发者大会。
春天来了，公园里的花都开了，非常美丽。
小猫坐在门口，安静地看着外面的小鸟。
这个城市的交通很方便，地铁可以到很多地方。
我们一起学习，一起进步，一起成长。
她的声音很温柔，听起来非常舒服。
明天上午我们要去北京参加会议。
"""

_CORPUS_MIXED = """\
我们使用 PyTorch 训练了一个 TTS 模型。
这个 API 的延迟大约是 120 毫秒。
今天的 meeting 改到下午三点了。
请把这个 file 发给我，谢谢。
VoxCPM 是一个 tokenizer-free 的语音合成模型。
我最喜欢的电影是 The Lord of the Rings。
(温柔的女声) 你好，欢迎收听今天的新闻。
(a calm male voice) Good evening, here is the news.
他在 GitHub 上发布了新的 release 版本。
这台服务器有 8 张 GPU，每张 80 GB 显存。
Hello 大家好，我是你们的 AI 助手。
2024年3月15日，天气晴，温度 25 度。
"""


def _training_lines(seed: int) -> list[str]:
    """Corpus lines with seed-dependent repetition counts (different seeds -> different merges)."""
    lines = [
        line.strip()
        for block in (_CORPUS_EN, _CORPUS_ZH, _CORPUS_MIXED)
        for line in block.splitlines()
        if line.strip()
    ]
    rng = random.Random(seed)
    weighted: list[str] = []
    for line in lines:
        weighted.extend([line] * rng.randint(1, 3))
    return weighted


def _special_name(idx: int) -> str:
    return _NAMED_SPECIAL.get(idx, f"<|reserved_{idx}|>")


def _train_merges(seed: int, budget: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Train BPE on the corpus; returns (non-special pieces in id order, merges in rank order)."""
    tok = Tokenizer(models.BPE(unk_token=UNK, byte_fallback=True, fuse_unk=True))
    # Training-time pre-tokenization mimics sentencepiece: pieces never cross word, digit or
    # punctuation boundaries. The saved tokenizer uses split=False (as transformers does); that gives
    # the same segmentation because no learned merge spans such a boundary.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=budget,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_training_lines(seed), trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    pieces = [p for p, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    return pieces, merges


def build_tokenizer(out_dir: str | Path, vocab_size: int = 2048, seed: int = 0) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``.

    The vocabulary has at most ``vocab_size`` entries (fewer when the embedded corpus runs out of
    merges). Deterministic for given arguments.
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"vocab_size must be >= {_MIN_VOCAB} (specials, byte pieces, alphabet), got {vocab_size}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    specials = [_special_name(i) for i in range(NUM_RESERVED_SPECIAL)]
    byte_pieces = [f"<0x{b:02X}>" for b in range(_NUM_BYTES)]
    trained_budget = vocab_size - len(specials) - len(byte_pieces)
    pieces, merges = _train_merges(seed, trained_budget)

    vocab: dict[str, int] = {}
    for piece in [*specials, *byte_pieces, *pieces]:
        if piece not in vocab:  # a trained piece can never collide, but keep ids dense regardless
            vocab[piece] = len(vocab)
    # The trainer may exceed the budget by its alphabet size; drop the tail and any merge needing it.
    if len(vocab) > vocab_size:
        vocab = {p: i for p, i in vocab.items() if i < vocab_size}
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True, fuse_unk=True, dropout=None)
    )
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    # Specials are already in the vocab, so this only marks them as atomic (ids do not move).
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    assert tok.get_vocab_size(with_added_tokens=True) == len(vocab) <= vocab_size
    tok.save(str(out / "tokenizer.json"), pretty=False)

    def token_entry(content: str) -> dict[str, object]:
        return {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        # legacy=False + (default) add_prefix_space=True -> Metaspace prepend_scheme "first" in
        # transformers 5. add_prefix_space is deliberately absent: transformers 4 would then insist on
        # converting from a sentencepiece model that we do not ship.
        "legacy": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "added_tokens_decoder": {str(i): token_entry(s) for i, s in enumerate(specials)},
        "additional_special_tokens": [
            AUDIO_START_TOKEN,
            AUDIO_END_TOKEN,
            REF_AUDIO_START_TOKEN,
            REF_AUDIO_END_TOKEN,
        ],
    }
    special_map = {
        "bos_token": token_entry(BOS),
        "eos_token": token_entry(EOS),
        "unk_token": token_entry(UNK),
        "additional_special_tokens": [
            AUDIO_START_TOKEN,
            AUDIO_END_TOKEN,
            REF_AUDIO_START_TOKEN,
            REF_AUDIO_END_TOKEN,
        ],
    }
    for name, payload in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out / name).write_text(json.dumps(payload, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
