"""Text normalisation for `normalize: true` requests: written forms become the words a reader would say.

Covered, in English and Chinese: cardinals, decimals, ordinals, fractions, currency ($ € £ ¥ ₹ ₩ ¢, with cents;
signed), dates (2025-09-28, 09/28/2025, September 28, 2025, 2025年9月28日), times (3:45 pm, 14:30), units (5 km, 3 kg,
100 km/h), percentages, temperatures, phone numbers (digit by digit), years and decades as said (1905 "nineteen oh
five", 2000s "two thousands") and dotted versions (2.0.1). Words in capitals are spoken as words when they can be
pronounced (HELLO, NASA) and spelled letter by letter when they cannot (FBI, HTML); a mostly-capitals sentence is read
as shouting, i.e. as ordinary words.

Text is split into language runs: a run of Latin text with two or more words inside Chinese text (or any text
without Chinese) goes through wetext's English grammar, everything else through its Chinese one. Our own rules fill
the grammars' gaps (cents, decades, the "oh" of 1905, versions, US dates and phone numbers in Chinese,
letter-hyphen-digit such as GPT-4, leftover digits through inflect).

Not covered: other languages (left as written), abbreviations beyond the grammars' few (Dr., Mr., No.), Roman
numerals (left as written), phone numbers written with spaces only in English (read as numbers), context (a capital
word that is also an acronym, 'US'), and markdown or emoji clean-up. Normalisation is per segment and keeps no
state between calls.

Loading (wetext's grammars, inflect) takes about 1.5 s and happens once per process, on the first call; a call then
costs about 1-3 ms per sentence. `normalize` is pure and thread-safe."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: tuple[Any, Any, Any] | None = None  # (English normaliser, Chinese normaliser, inflect engine)
_inflect_lock = threading.Lock()  # inflect's engine keeps per-call counters on itself

# Han ideographs decide that a text is Chinese; CJK punctuation and full-width forms belong to Chinese runs.
_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_CJK = r"\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_NON_CJK_STRETCH = re.compile(f"[^{_CJK}]+")
_LATIN_WORD = re.compile(r"[A-Za-z]+")
_LATIN_LETTER = re.compile(r"[A-Za-z\u00c0-\u024f\uff21-\uff3a\uff41-\uff5a]")  # full-width Latin too
# kana, without the middle dot and the long-vowel mark that Chinese writes too (迈克尔・杰克逊)
_KANA = re.compile(r"[\u3040-\u30fa\u30fd-\u30ff\u31f0-\u31ff\uff66-\uff9f]")


def _other_script(run: str) -> bool:
    """An English run of another script than the grammars' (Hangul, Cyrillic, Greek, Arabic, ...): left as written
    ("У меня 3 яблока" read "У меня three яблока"). Latin-script languages cannot be told from English here."""
    letters = [c for c in run if c.isalpha()]
    latin = sum(1 for c in letters if _LATIN_LETTER.match(c))
    return len(letters) - latin > latin


def _split_words(words: str) -> list[str]:
    return words.split()


def _load() -> tuple[Any, Any, Any]:
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                import inflect
                from wetext import Normalizer

                english = Normalizer(lang="en", operator="tn")
                # erhua kept: normalisation changes how things are written, not which words are said
                chinese = Normalizer(lang="zh", operator="tn", remove_erhua=False)
                english.normalize("1")  # reads the grammars now, not in the first request
                chinese.normalize("1")
                _loaded = (english, chinese, inflect.engine())
    return _loaded


def load() -> None:
    """Read the grammars now (a process that will normalise: its first call need not wait for them)."""
    _load()


def normalize(text: str) -> str:
    """`text` with numbers, amounts, dates, times, units and capitals written as they are spoken. Leading and
    trailing white space of each language run is kept; the grammars collapse white space inside a run."""
    if not text.strip():
        return text
    english, chinese, _ = _load()
    # 10 000 (SI style) before white space is collapsed (the no-break spaces with the rest)
    text = _SPACED_THOUSANDS.sub(lambda m: re.sub(r"\D", "", m.group()), text)
    out = []
    if _KANA.search(text):  # Japanese: neither grammar's (the Chinese one read its digits as Chinese)
        return text
    for run, lang in (r for chunk in _chunks(text) for r in _runs(chunk)):
        core = " ".join(run.split())  # as the engine reads it; wetext fails on runs of spaces
        if not core:
            out.append(run)
            continue
        if lang == "en" and _other_script(core):
            out.append(run)
            continue
        lead, trail = run[:len(run) - len(run.lstrip())], run[len(run.rstrip()):]
        spoken = _english(english, core) if lang == "en" else _chinese(chinese, core)
        # shouting is a sentence's: a run holds several
        out.append(lead + "".join(map(_capitals, _SENTENCE_END.split(spoken))) + trail)
    return "".join(out)


VOICE_DESIGN = re.compile(r"\s*\([^()]*\)")


def normalize_target(text: str) -> str:
    """A request's target text normalised, keeping a leading '(description)' of voice design as written."""
    m = VOICE_DESIGN.match(text)
    return text[:m.end()] + normalize(text[m.end():]) if m else normalize(text)


# The grammars' cost grows faster than the text's length: long text is normalised a few sentences at a time.
_CHUNK_CHARS = 200
_CLAUSE_END = re.compile(r"(?<=[,，、])")
_WORD_END = re.compile(r"(?<=\s)(?=\S)")
_SENTENCE_END = re.compile(r"(?<=[。！？；!?;\n])|(?<=\.)(?=\s+[A-Z\u4e00-\u9fff\"“(])")


def _chunks(text: str) -> list[str]:
    """`text` cut after sentence ends into pieces of about _CHUNK_CHARS; a longer sentence is cut after commas, a
    clause longer still between words, and a word longer still (no space in it: "1.1.1...") every _CHUNK_CHARS."""
    if len(text) <= _CHUNK_CHARS:
        return [text]
    pieces = [p for sentence in _SENTENCE_END.split(text)
              for clause in (_CLAUSE_END.split(sentence) if len(sentence) > _CHUNK_CHARS else [sentence])
              for word in (_WORD_END.split(clause) if len(clause) > _CHUNK_CHARS else [clause])
              for p in ([word[i:i + _CHUNK_CHARS] for i in range(0, len(word), _CHUNK_CHARS)]
                        if len(word) > _CHUNK_CHARS else [word])]
    chunks = [""]
    for sentence in pieces:
        if chunks[-1] and len(chunks[-1]) + len(sentence) > _CHUNK_CHARS:
            chunks.append("")
        chunks[-1] += sentence
    return chunks


# --- language runs ----------------------------------------------------------------------------------


def _runs(text: str) -> list[tuple[str, str]]:
    """(run, 'en' | 'zh') covering `text` in order. Without Han characters it is one English run; with them, a
    stretch free of CJK characters holding two or more Latin words is English (a phrase), the rest Chinese, so
    '3个', '5km' and 'NASA' inside Chinese are read by the Chinese grammar."""
    if not _HAN.search(text):
        return [(text, "en")]
    runs: list[tuple[str, str]] = []
    pos = 0
    for m in _NON_CJK_STRETCH.finditer(text):
        if len(_LATIN_WORD.findall(m.group())) >= 2:
            if m.start() > pos:
                runs.append((text[pos:m.start()], "zh"))
            runs.append((m.group(), "en"))
            pos = m.end()
    if pos < len(text):
        runs.append((text[pos:], "zh"))
    return runs


def _grammar(grammar: Any, text: str) -> str:
    """wetext's normalisation; text its grammar cannot parse is halved at a space and each half read alone, down to
    the word it fails on, which is kept as it is (one odd word kept its whole run of up to 200 characters as
    written), rather than failing the request."""
    try:
        out = grammar.normalize(text)
    except Exception:  # an assertion or a parse failure inside the grammar's token parser
        spaces = [m.start() for m in re.finditer(r" ", text)]
        if not spaces:
            log.warning("normalisation kept a word as written: the grammar failed on %r", text[:80])
            return text
        cut = spaces[len(spaces) // 2]
        return _grammar(grammar, text[:cut]) + " " + _grammar(grammar, text[cut + 1:])
    if not out or out == text:  # the grammar passed the run through (nothing to normalise): nothing escaped
        return text
    return _GRAMMAR_ESCAPE.sub(r"\1", out)  # its token parser escapes " and \\ in what it writes


# --- English ----------------------------------------------------------------------------------------

_CURRENCY = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
             "£": ("pound", "pounds", "penny", "pence"), "¥": ("yen", "yen", None, None),
             "₹": ("rupee", "rupees", "paisa", "paise"), "₩": ("won", "won", None, None)}
_SYMBOL = f"[{re.escape(''.join(_CURRENCY))}]"  # one currency symbol of the table
_MONEY = re.compile(rf"(?<![\w.])({_SYMBOL})\s?(\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.(\d{{1,2}}))?(?!\.?\d)"
                    r"(?:\s?(thousand|million|billion|trillion)\b)?", re.ASCII)
# an amount's magnitude as a letter ($1.2B, $5M, $3K, $2.5bn): the word the amount's rule reads ("1.2B" was
# "one dollar and twenty centsB")
_MONEY_MAGNITUDE = re.compile(rf"((?<![\w.]){_SYMBOL}\s?\d+(?:\.\d+)?)(?:(K|k|M|B|T)|\s?(MM|mn|bn|tn))"
                              r"(?![\w&'’-])")
_MAGNITUDES = {"K": "thousand", "k": "thousand", "M": "million", "MM": "million", "mn": "million", "B": "billion",
               "bn": "billion", "T": "trillion", "tn": "trillion"}
# "m" after a number is the metre (SI; minutes are "min"): the grammar read "1.8 m" as "one point eight minutes"
_METRES = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?m(/s)?(?![\w/²³^])")
_SIGNED_CURRENCY = re.compile(rf"(?<![\w.])({_SYMBOL})(-)(?=\d)")  # then swapped: (sign)(symbol)
# digits grouped in threes by a no-break, narrow no-break or thin space (a plain space may part two numbers)
_SPACED_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:[\u00a0\u202f\u2009]\d{3})+(?![\d]|[.,]\d{3})")
_NEGATIVE_MONEY = re.compile(rf"(?<![\w.])-(?={_SYMBOL}\d)")
_CENTS = re.compile(r"(?<![\d.,])(\d+)\s?¢")
# a plus before a number that is no phone number (those are read digit by digit): +3.5%, +5 points
_PLUS = re.compile(r"(?<![\w+])\+(?=\d+(?:\.\d+)?(?:%|\s|$|[.,;:!?)]))(?!\d{1,3}[\s-]+\(?\d)")
_DECADE = re.compile(r"\b(1[1-9]|2[0-9])([0-9]0)s\b", re.ASCII)
# Years the grammar reads in pairs with "zero" for the 0 (1905: "nineteen zero five"); 2001-2009 it reads "two thousand"
_YEAR_OH = re.compile(r"(?<![\d.,])(1[0-9]|2[1-9])0([1-9])(?!\d|[.,]\d)", re.ASCII)
# 1,000-1,999 (a thousands comma) and 1000-1999 with decimals: the grammar drops their "one" ("thousand and one").
# Not beside a letter or a hyphen (a name, a negative number, a range: the grammar's own readings).
_ONE_THOUSAND = re.compile(r"(?<![\w.,-])(?<!- )(1,\d{3}(?:\.\d+)?|1\d{3}\.\d+)(?![\w-]|[.,]\d| -)", re.ASCII)
# 1000 or 1000.x as the grammar reads them after `_one_thousand` and `_four_digits` left them as digits (so that it
# still reads a unit after them): "ten hundred", or "thousand point" after a word that is no number.
_TEN_HUNDRED = re.compile(r"\bten hundred\b")
_BARE_THOUSAND_POINT = re.compile(r"\b([a-z]+ )?thousand point\b")
_NUMBER_WORDS = frozenset(_split_words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million billion "
    "trillion point negative minus and"))
# 1000-2999 alone, which the grammar reads as a year ("twelve thirty four"): kept for it where the context says year (a
# preposition or month before it, a day and comma, the start of a sentence, an era or 's after it), else a quantity.
_FOUR_DIGITS = re.compile(r"(?<![\w.,:/$€£¥+-])(?<!- )([12])(\d{3})(?![\w:/-]|[.,]\d| -)")
_YEAR_WORDS = frozenset(_split_words(
    "in since by from until till to of during before after around circa c year years summer winter spring autumn "
    "fall early late mid january february march april may june july august september october november december "
    "jan feb mar apr jun jul aug sep sept oct nov dec"))
# ... unless a unit of length, mass or volume follows ("in 1500 meters", "by 1500 km"): not a single letter ("In 1923
# W. B. Yeats"), nor a counted or timed noun ("In 1905 people", "by 1900 hours", "in 1500 years" are said in pairs), nor
# a currency ("in 2010 dollars"); after a label the grammar's pairs are how it is said ("Room 1905": nineteen oh five).
_QUANTITY_AFTER = re.compile(
    r"\s?(?:%|°|(?:mm|cm|km|mi|ft|yd|mg|kg|lbs?|oz|ml|mph|km/h|kph)(?![A-Za-z-]))"
    r"|\s(?:square |cubic |nautical |metric )?(?:meters?|metres?|kilomet(?:er|re)s?|miles?|feet|yards?|inch(?:es)?|"
    r"pounds?|kilo(?:gram)?s?|grams?|tons?|tonnes?|lit(?:er|re)s?|gallons?)\b(?![.-]\w)")
_LABEL_WORDS = frozenset(_split_words(
    "room rm flight suite apartment apt bus route gate platform highway interstate channel extension ext"))
_WORD_BEFORE = re.compile(r"([A-Za-z]+)\.?\s+$")
_DAY_COMMA = re.compile(r"\d{1,2}(?:st|nd|rd|th)?,\s*$")
_SENTENCE_END_BEFORE = re.compile(r"[.!?:;\n][\s\"'(]*$")
_ERA_AFTER = re.compile(r"\s*(?:BCE|CE|BC|AD|B\.C\.|A\.D\.)(?![A-Za-z])|'s\b")
_DOTTED = re.compile(r"(?<![\d.])\d+(?:\.\d+){2,}(?![\d.])", re.ASCII)
_GRAMMAR_ESCAPE = re.compile(r'\\(["\\])')
_NUMBER_ABBREV = re.compile(r"\bNo\.\s*(?=\d)", re.ASCII)
_DIGITS = re.compile(r"\d+", re.ASCII)
# +86 138 1234 5678, +44-20-7946-0958: a plus, a country code and two or more groups (the grammars miss spaced ones)
_INTL_PHONE = re.compile(r"(?<![A-Za-z0-9+])\+(\d{1,3})((?:[\s-]+\(?\d{1,5}\)?){2,5})(?!\d)", re.ASCII)
_EN_DIGITS = dict(zip("0123456789", _split_words("zero one two three four five six seven eight nine"), strict=True))


def _phone_en(m: re.Match[str]) -> str:
    groups = [m.group(1), *re.findall(r"\d+", m.group(2))]
    return "plus " + ", ".join(" ".join(_EN_DIGITS[d] for d in g) for g in groups)


def _words(n: int | str) -> str:
    """inflect's words without its commas and hyphens, as the grammars write numbers; past trillions (inflect's last
    scale word) digit by digit."""
    digits = str(n)
    if len(digits) > 15:
        return " ".join(_EN_DIGITS[d] for d in digits)
    with _inflect_lock:
        words = _load()[2].number_to_words(digits, andword="")
    return re.sub(r"\s+", " ", words.replace(",", " ").replace("-", " ")).strip()


def _money(m: re.Match[str]) -> str:
    symbol, whole, frac, scale = m.group(1), m.group(2).replace(",", ""), m.group(3), m.group(4)
    one, many, sub_one, sub_many = _CURRENCY[symbol]
    if scale:  # $2.5 million: two point five million dollars
        amount = _words(whole) + (" point " + " ".join(_words(d) for d in frac) if frac else "")
        return f"{amount} {scale} {many}"
    if frac and sub_one is None:  # yen has no subunit
        return f"{_words(whole)} point {' '.join(_words(d) for d in frac)} {many}"
    spoken = f"{_words(whole)} {one if int(whole) == 1 else many}"
    cents = int(frac.ljust(2, "0")) if frac else 0
    if cents:
        spoken += f" and {_words(cents)} {sub_one if cents == 1 else sub_many}"
    return spoken


def _one_thousand(m: re.Match[str]) -> str:
    """"one thousand" and the rest as digits, which the grammar still reads with what follows (a unit, a currency)."""
    whole, _, frac = m.group(1).replace(",", "").partition(".")
    rest = int(whole[1:])
    if rest == 0:  # digits for the grammar (a unit after them), its "ten hundred" / "thousand point" fixed after it
        return whole + (f".{frac}" if frac else "")
    return f"one thousand {rest}" + (f".{frac}" if frac else "")


def _one_thousand_point(m: re.Match[str]) -> str:
    before = m.group(1) or ""
    return m.group() if before.strip() in _NUMBER_WORDS else f"{before}one thousand point"


def _four_digits(m: re.Match[str]) -> str:
    """A year as written (the grammar's pairs); a quantity as "one / two thousand" and the rest in digits, which the
    grammar reads with what follows (a unit)."""
    before = m.string[max(0, m.start() - 40):m.start()]  # a window: a long text's numbers are not quadratic
    word = _WORD_BEFORE.search(before)
    word = word.group(1).lower() if word is not None else ""
    if _ERA_AFTER.match(m.string, m.end()) or word in _LABEL_WORDS:
        return m.group()
    if not _QUANTITY_AFTER.match(m.string, m.end()) and (
            word in _YEAR_WORDS or _DAY_COMMA.search(before) or _SENTENCE_END_BEFORE.search(before)
            or (m.start() <= 40 and not before.strip(" \t\"'("))):
        return m.group()
    rest = int(m.group(2))
    if rest == 0:  # 1000, 2000: the grammar reads them as quantities (1000's "ten hundred" fixed after it)
        return m.group()
    return f"{'one' if m.group(1) == '1' else 'two'} thousand {rest}"


def _decade(m: re.Match[str]) -> str:
    if m.group(1) == "20" and m.group(2) == "00":  # 2000s: two thousands, as 2000-2009 are "two thousand ..."
        return "two thousands"
    if m.group(2) == "00":  # 1900s: nineteen hundreds
        return _words(m.group(1)) + " hundreds"
    words = _words(m.group(1)) + " " + _words(m.group(2))  # 1990s: nineteen nineties
    return words[:-1] + "ies" if words.endswith("y") else words + "s"


def _dotted(m: re.Match[str]) -> str:
    """A version or an address (2.0.1): its numbers with "dot" between, apart from a word it follows (v2.0.1)."""
    lead = " " if m.start() and m.string[m.start() - 1].isalpha() else ""
    return lead + " dot ".join(_words(p) for p in m.group().split("."))


def _metres(m: re.Match) -> str:
    unit = "metre" if m.group(1) == "1" else "metres"
    return f"{m.group(1)} {unit} per second" if m.group(2) else f"{m.group(1)} {unit}"


def _english(grammar: Any, text: str) -> str:
    text = text.replace("\u2212", "-")  # the minus sign: the grammar reads only the hyphen-minus
    text = _SIGNED_CURRENCY.sub(r"\2\1", text)  # $-3.50: -$3.50
    text = _NEGATIVE_MONEY.sub("minus ", text)  # -$3.50 (the amount's own rule leaves the sign unread)
    text = _CENTS.sub(lambda m: f"{m.group(1)} {'cent' if m.group(1) == '1' else 'cents'}", text)
    text = _PLUS.sub("plus ", text)
    text = _INTL_PHONE.sub(_phone_en, text)
    text = _MONEY_MAGNITUDE.sub(lambda m: f"{m.group(1)} {_MAGNITUDES[m.group(2) or m.group(3)]}", text)
    text = _MONEY.sub(_money, text)
    text = _METRES.sub(_metres, text)
    text = _DECADE.sub(_decade, text)
    text = _DOTTED.sub(_dotted, text)
    text = _ONE_THOUSAND.sub(_one_thousand, text)
    text = _FOUR_DIGITS.sub(_four_digits, text)
    text = _NUMBER_ABBREV.sub("number ", text)
    years = {m.group(1, 2) for m in _YEAR_OH.finditer(text)}
    thousands = len(re.findall(r"(?<![\d.,])1000(?!\d|,\d)", text))  # the grammar's "ten hundred" of these
    text = _grammar(grammar, text)
    if thousands:
        text = _TEN_HUNDRED.sub("one thousand", text, count=thousands)
        text = _BARE_THOUSAND_POINT.sub(_one_thousand_point, text, count=thousands)
    for century, digit in years:  # 1905: nineteen oh five, as people say it (the grammar says "zero")
        pair = (_words(century), _words(digit))
        text = re.sub(rf"\b{pair[0]} zero {pair[1]}\b", f"{pair[0]} oh {pair[1]}", text)
    return _DIGITS.sub(lambda m: _words(m.group()), text)  # what the grammar left


# --- Chinese ----------------------------------------------------------------------------------------

_US_DATE = re.compile(r"(?<!\d)(0?[1-9]|1[0-2])/(0?[1-9]|[12]\d|3[01])/(\d{4})(?!\d)", re.ASCII)
_LETTER_HYPHEN_DIGIT = re.compile(r"(?<=[A-Za-z])-(?=\d)")
_ZH_DIGITS = dict(zip("0123456789", "零幺二三四五六七八九", strict=True))


def _phone_zh(m: re.Match[str]) -> str:
    digits = re.sub(r"\D", "", m.group(1) + m.group(2))
    return "加" + "".join(_ZH_DIGITS[d] for d in digits)


def _chinese(grammar: Any, text: str) -> str:
    text = _US_DATE.sub(lambda m: f"{m.group(3)}年{int(m.group(1))}月{int(m.group(2))}日", text)
    text = _LETTER_HYPHEN_DIGIT.sub(" ", text)  # GPT-4 is a name, not GPT minus four
    text = _INTL_PHONE.sub(_phone_zh, text)
    return _grammar(grammar, text)


# --- words in capitals ------------------------------------------------------------------------------

_CAPS = re.compile(r"(?<![A-Za-z])[A-Z]{2,}(?![A-Za-z])")
_ROMAN = re.compile(r"X{0,3}(?:IX|IV|V?I{0,3})")
_VOWELS = set("aeiouy")
_ONSETS = frozenset(_split_words(
    "b c d f g h j k l m n p q r s t v w x z bl br ch cl cr dr fl fr gl gr kl kn kr ph pl pr qu sc sh sk sl sm sn sp "
    "st sw th tr tw wh wr chr phr sch scr shr spl spr squ str thr"))
_CODAS = frozenset(_split_words(
    "ch ck ct ds ff ft gh gs ld lf lk ll lm ln lp ls lt mb mp ms nd ng nk ns nt ps pt rb rc rd rf rg rk rl rm rn rp rs "
    "rt sh sk sp ss st th ts tz ws wn xt zz ght lch lds lts mps nch nds ngs nks nts rch rds rks rld rms rns rst rts "
    "sks sts tch"))
# Short words that are spoken, not spelled, when a whole sentence is in capitals.
_COMMON = frozenset(_split_words(
    "am an as at be by do go he if in is it me my no of oh ok on or so to up us we all and any are but can did for get "
    "got had has her him his how its let may new not now off old one our out see she the too two use was way who why "
    "yes yet you"))


def _pronounceable(word: str) -> bool:
    """A rough English phonotactics check on a lower-case word: a legal onset, no run of three vowels, consonant
    runs of at most three inside and a legal coda at the end."""
    clusters = re.findall(r"[^aeiouy]+|[aeiouy]+", word)
    if not any(c[0] in _VOWELS for c in clusters) or any(c[0] in _VOWELS and len(c) > 2 for c in clusters):
        return False
    first, last = clusters[0], clusters[-1]
    if first[0] not in _VOWELS and first not in _ONSETS:
        return False
    if last[0] not in _VOWELS and len(last) > 1 and last not in _CODAS:
        return False
    return all(len(c) <= 3 for c in clusters[1:-1])


def _capitals(text: str) -> str:
    words = [w for w in _LATIN_WORD.findall(text) if len(w) >= 2]
    caps = [w for w in words if w.isupper()]
    shouting = len(caps) >= 2 and len(caps) >= 0.6 * len(words)

    def say(m: re.Match[str]) -> str:
        word = m.group()
        if _ROMAN.fullmatch(word):
            return word
        lower = word.lower()
        if shouting and (lower in _COMMON or (len(word) >= 4 and _pronounceable(lower))):
            return lower
        if not shouting and len(word) >= 4 and _pronounceable(lower):
            return lower
        return " ".join(word)

    return _CAPS.sub(say, text)
