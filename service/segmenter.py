"""Text -> segments sized for one generation each. Sentence boundaries come from `sentencex` (abbreviations,
decimals, closing quotes, punctuation runs, CJK terminals); our rules split what is still too long at clause marks,
then spaces, then a hard cut, and merge short tails. Offsets index the text as written, so timings map back to it.

Lengths are weighted by speaking time: a CJK character takes about as long to say as three Latin ones (Chinese
~4.5 characters/s, English ~14), so `max_chars` means about the same duration in either script.
"""

from __future__ import annotations

import logging
import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Literal

import sentencex

Pause = Literal["sentence", "paragraph", "none"]
PAUSES: tuple[Pause, ...] = ("none", "sentence", "paragraph")  # weakest first
Granularity = Literal["sentence", "clause"]
DEFAULT_MAX_CHARS = 250  # ~18 s of English or ~80 Chinese characters: under the ~20 s where quality degrades
CJK_WEIGHT = 3
CLAUSE_MARKS = ",;:，、；：—–…"
CLOSERS = "\"'”’»)]}）」』》】"
CJK_TERMINALS = "。！？"
SENTENCE_TERMINALS = ".!?…" + CJK_TERMINALS  # a flushed buffer ending otherwise is an unfinished sentence
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")
log = logging.getLogger(__name__)
# White space but ASCII's space, tab and line breaks (no-break, ideographic, thin spaces, U+2028...): sentencex (1.0.x)
# panics on some of it before a period ("I\u3000."), so it reads a space there (one character for one: same offsets).
_WIDE_SPACE = re.compile(r"[^\S\n\r\t\f\v ]")
_CLAUSE_END = re.compile(f"[{re.escape(CLAUSE_MARKS)}]+[{re.escape(CLOSERS)}]*")


@dataclass(frozen=True)
class Segment:
    index: int
    text: str  # text[start:end] of the text as written
    start: int
    end: int
    pause: Pause  # what follows it: a sentence's pause, a paragraph's, or none (cut mid-sentence, or the last)


def weight(text: str) -> int:
    """Length in Latin-character equivalents of speaking time."""
    return len(text) + (CJK_WEIGHT - 1) * len(_CJK.findall(text))


def language_of(text: str) -> str:
    """sentencex's language: Chinese rules where CJK characters dominate (abbreviations of English otherwise)."""
    sample = text[:2000]
    cjk = len(_CJK.findall(sample))
    return "zh" if cjk * 2 > len(sample.strip() or "x") else "en"


@dataclass
class _Unit:
    start: int
    end: int
    pause: Pause
    sentence: int = -1  # which sentence a piece of a cut one belongs to (-1: a whole sentence, or any clause)


_BLANK_LINE = re.compile(r"\n[^\S\n]*\n")


def _sentences(text: str, base: int = 0) -> list[_Unit]:
    """sentencex's sentences with words (`_has_words`), stripped of surrounding space; a paragraph break marks the
    sentence before it."""
    units: list[_Unit] = []
    try:
        bounds = sentencex.get_sentence_boundaries(language_of(text), _WIDE_SPACE.sub(" ", text))
    except BaseException as e:  # a panic in the library (a BaseException): the text as one sentence, never a 500
        if type(e).__name__ != "PanicException":
            raise
        log.warning("sentencex failed on a text of %d characters (%s): read as one sentence", len(text), e)
        bounds = [{"start_index": 0, "end_index": len(text)}]
    for b in bounds:
        if b.get("is_paragraph_break"):
            if units:
                units[-1].pause = "paragraph"
            continue
        s, e = b["start_index"], b["end_index"]
        piece = text[s:e]
        lead = len(piece) - len(piece.lstrip())
        trail = len(piece) - len(piece.rstrip())
        if e - trail > s + lead and _has_words(piece):
            units.append(_Unit(base + s + lead, base + e - trail, "sentence"))
        if "\n\n" in piece[len(piece.rstrip()):] and units:
            units[-1].pause = "paragraph"
    # a blank line holding spaces or tabs is one too ("\n \n", "\r\n\t\r\n")
    for before, after in zip(units, units[1:], strict=False):
        if _BLANK_LINE.search(text, before.end - base, after.start - base):
            before.pause = "paragraph"
    return units


def _has_words(text: str) -> bool:
    """Whether a sentence has a letter or a digit to say: one without ("***" between paragraphs, "—", an emoji, a
    zero-width space) is no generation of its own (the model would babble to its length cap); beside words in a
    segment it is read with them."""
    return any(unicodedata.category(c)[0] in "LN" for c in text)


def _ends_clause(text: str, m: re.Match[str]) -> bool:
    """Whether a clause mark ends a clause: followed by space or CJK text, or itself CJK (not the comma of 1,234, the
    colon of 10:45)."""
    cut = m.end()
    return cut >= len(text) or text[cut].isspace() or bool(_CJK.match(text[m.start()]) or _CJK.match(text[cut]))


def _clauses(text: str, unit: _Unit) -> list[_Unit]:
    """A sentence's clauses (a comma, semicolon, colon, dash or CJK clause mark followed by space or CJK text)."""
    out: list[_Unit] = []
    s = unit.start
    for m in _CLAUSE_END.finditer(text, unit.start, unit.end):
        cut = m.end()
        if cut >= unit.end:
            break
        if _ends_clause(text, m):
            out.append(_Unit(s, cut, "none"))
            s = cut
            while s < unit.end and text[s].isspace():
                s += 1
    out.append(_Unit(s, unit.end, unit.pause))
    return [u for u in out if u.end > u.start]


def _cut_point(text: str, start: int, end: int, max_chars: int, total: int) -> int:
    """Where to cut text[start:end] (too long; `total`: its weight): near an equal share of it, never past max_chars
    of weight, at the clause mark nearest that share, else the space nearest it, else anywhere (hard cut). Reads
    only max_chars of text, so that a long sentence's cuts cost linear time."""
    parts = math.ceil(total / max_chars)
    share = total / parts
    limit, acc = start, 0
    ideal = start
    for i in range(start, end):
        acc += CJK_WEIGHT if _CJK.match(text[i]) else 1
        if acc <= share:
            ideal = i + 1
        if acc > max_chars:
            break
        limit = i + 1
    low = start + max(1, (ideal - start) // 2)
    best_clause = best_space = None
    for m in _CLAUSE_END.finditer(text, low, limit):
        if m.end() <= limit and _ends_clause(text, m):
            best_clause = m.end() if abs(m.end() - ideal) < abs((best_clause or -10**9) - ideal) else best_clause
    if best_clause is not None:
        return best_clause
    for i in range(low, limit):
        if text[i].isspace() and (best_space is None or abs(i - ideal) < abs(best_space - ideal)):
            best_space = i
    if best_space is not None:
        return best_space
    # no mark, no space (CJK text): between two characters that are not both of one Latin word or number
    joined = [i for i in range(max(low, start + 1), limit) if not (_in_word(text[i - 1]) and _in_word(text[i]))]
    return min(joined, key=lambda i: abs(i - ideal)) if joined else max(ideal, start + 1)


def _in_word(c: str) -> bool:
    """A letter or digit of a word written with spaces (Latin, Cyrillic...; not CJK)."""
    return c.isalnum() and not _CJK.match(c)


def _fit(text: str, unit: _Unit, max_chars: int, growing: bool = False) -> list[_Unit]:
    """A unit -> pieces of at most max_chars weight, cut at clause marks, spaces, then anywhere: near equal shares, or
    of about max_chars each where the unit is still `growing` (a live sentence: its last piece waits for more)."""
    out: list[_Unit] = []
    s = unit.start
    rest = weight(text[s:unit.end])  # of text[s:unit.end], kept up to date (not recounted: linear time)
    while rest > max_chars:
        cut = _cut_point(text, s, unit.end, max_chars, max(rest, 2 * max_chars) if growing else rest)
        end = cut
        while end > s and text[end - 1].isspace():
            end -= 1
        out.append(_Unit(s, end, "none"))
        following = cut
        while following < unit.end and text[following].isspace():
            following += 1
        rest -= weight(text[s:following])
        s = following
    if unit.end > s:
        out.append(_Unit(s, unit.end, unit.pause))
    return out


def _spoken(text: str, units: list[_Unit]) -> list[_Unit]:
    """The units with words to say: a piece of a cut sentence that is all zero-width spaces or asterisks is no
    generation either (`_has_words`); a unit left out hands its pause to the one before it."""
    out: list[_Unit] = []
    for u in units:
        if _has_words(text[u.start:u.end]):
            out.append(u)
        elif out:
            out[-1].pause = max(out[-1].pause, u.pause, key=PAUSES.index)
    return out


def _joinable(a: _Unit, b: _Unit) -> bool:
    """Whole sentences join whole sentences, pieces of a cut sentence join pieces of the same one; never across a
    paragraph."""
    return a.pause != "paragraph" and a.sentence == b.sentence


def _pack(text: str, units: list[_Unit], max_chars: int) -> list[_Unit]:
    """Consecutive units joined while they fit max_chars, then a short tail merged into the segment before it when
    the two still fit 1.5 x max_chars."""
    packed: list[_Unit] = []
    for u in units:
        last = packed[-1] if packed else None
        if last is not None and _joinable(last, u) and weight(text[last.start:u.end]) <= max_chars:
            last.end, last.pause = u.end, u.pause
        else:
            packed.append(_Unit(u.start, u.end, u.pause))
    merged: list[_Unit] = []
    for u in packed:
        last = merged[-1] if merged else None
        short = weight(text[u.start:u.end]) < max_chars // 5
        if (last is not None and short and _joinable(last, u)
                and weight(text[last.start:u.end]) <= max_chars * 3 // 2):
            last.end, last.pause = u.end, u.pause
        else:
            merged.append(u)
    return merged


def split_text(text: str, max_chars: int = DEFAULT_MAX_CHARS, granularity: Granularity = "sentence",
               base: int = 0) -> list[Segment]:
    """Split `text` into segments of at most `max_chars` weighted characters (a merged short tail: up to 1.5 x).
    "sentence": segments end at sentence ends unless a sentence alone is too long; "clause": they may end at any
    clause mark (fuller segments). Offsets are into `text`, plus `base`."""
    if max_chars < 1:
        raise ValueError("max_chars must be positive")
    units: list[_Unit] = []
    for number, sentence in enumerate(_sentences(text)):
        pieces = _clauses(text, sentence) if granularity == "clause" else [sentence]
        for piece in pieces:
            fitted = _fit(text, piece, max_chars)
            if granularity == "sentence" and len(fitted) > 1:
                for f in fitted:
                    f.sentence = number
            units.extend(fitted)
    units = _pack(text, _spoken(text, units), max_chars)
    if units:
        units[-1].pause = "none"
    return [Segment(i, text[u.start:u.end], base + u.start, base + u.end, u.pause) for i, u in enumerate(units)]


BUFFER_MAX_FACTOR = 4  # a live buffer longer than this many max_chars is flushed (LiveSegmenter.feed)


class LiveSegmenter:
    """Text arriving in pieces (an LLM's tokens) -> segments as soon as each is complete: a Latin sentence once the
    next one has begun (so "3." of "3.14", "Dr." or "e.g." wait for the next word), a CJK one at its terminal, a
    clause ("clause") at its mark followed by more text; text past max_chars is cut at once. `flush()` speaks what
    is buffered now, `done()` the rest. Offsets are into the whole text fed so far."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS, granularity: Granularity = "sentence") -> None:
        self.max_chars, self.granularity = max_chars, granularity
        self.buffer = ""
        self.offset = 0  # where the buffer starts in the whole text
        self.count = 0  # segments emitted
        self.words = False  # the buffer has a letter or digit (without, it makes no segment: not scanned again)

    def feed(self, delta: str) -> list[Segment]:
        if not delta:
            return []  # nothing new: an empty message read the whole buffer again
        out = self._feed(delta)
        if len(self.buffer) > BUFFER_MAX_FACTOR * self.max_chars:
            # only text without words piles up so (behind a sentence that waits for the next to begin; a sentence
            # past max_chars is cut at once): what is left is spoken now, for each message read all of it again
            out += self.flush()
        return out

    def _feed(self, delta: str) -> list[Segment]:
        self.buffer += delta
        self.words = self.words or _has_words(delta)
        if not self.buffer.strip():  # white space alone: nothing of it is spoken, so it need not be read again
            self.offset += len(self.buffer)
            self.buffer = ""
        units = _sentences(self.buffer) if self.words else []  # none without words, however long ("$" before "5")
        if not units:
            return []
        complete = units[:-1]
        last = units[-1]
        if self.buffer[last.end - 1] in CJK_TERMINALS:
            complete, pending = units, None
        else:  # a Latin sentence is complete once the next one has begun ("Dr." and "e.g." are not ends)
            pending = last
        out: list[_Unit] = []
        for u in complete:
            pieces = _clauses(self.buffer, u) if self.granularity == "clause" else [u]
            for piece in pieces:
                out.extend(_fit(self.buffer, piece, self.max_chars))
        if pending is not None:
            pieces = _clauses(self.buffer, pending) if self.granularity == "clause" else [pending]
            for piece in pieces[:-1]:
                out.extend(_fit(self.buffer, piece, self.max_chars))
            fitted = _fit(self.buffer, pieces[-1], self.max_chars, growing=True)
            out.extend(fitted[:-1])  # the last piece may still grow
        return self._emit(_spoken(self.buffer, out), out[-1].end if out else 0)

    def flush(self) -> list[Segment]:
        """What is buffered, as one segment (or none if it is blank); cut if it exceeds max_chars."""
        out = self._buffered()
        if out:  # the buffered sentences as one segment where they fit
            out = _pack(self.buffer, out, self.max_chars)
            if self.buffer.rstrip().rstrip(CLOSERS)[-1:] not in SENTENCE_TERMINALS:  # cut mid-sentence: no pause
                out[-1].pause = "none"
        return self._emit(out, len(self.buffer))

    def done(self) -> list[Segment]:
        """The end of the input: everything left."""
        units = _pack(self.buffer, self._buffered(), self.max_chars)
        if units:
            units[-1].pause = "none"
        return self._emit(units, len(self.buffer))

    def _buffered(self) -> list[_Unit]:
        """The buffered sentences' pieces that have words to say."""
        if not self.words:
            return []
        return _spoken(self.buffer, [p for u in _sentences(self.buffer) for p in _fit(self.buffer, u, self.max_chars)])

    def _emit(self, units: list[_Unit], consumed: int) -> list[Segment]:
        """`units` (those with words: `_spoken`) as segments; the buffer read up to `consumed`."""
        segments = [Segment(self.count + i, self.buffer[u.start:u.end], self.offset + u.start, self.offset + u.end,
                            u.pause) for i, u in enumerate(units)]
        self.count += len(segments)
        self.buffer = self.buffer[consumed:]
        self.offset += consumed
        if consumed:
            self.words = _has_words(self.buffer)
        return segments
