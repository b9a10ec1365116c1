"""The segmenter's table of cases: where text is cut, what each segment's pause is, and that every segment is the
text as written at its offsets."""

from __future__ import annotations

import re

import pytest

from service.segmenter import LiveSegmenter, split_text, weight

CASES = [  # (text, max_chars, expected segment texts)
    ("Dr. Smith arrived. He paid $3.14, e.g. for tea.", 20, ["Dr. Smith arrived.", "He paid $3.14,", "e.g. for tea."]),
    ("Pi is 3.14159. Next.", 200, ["Pi is 3.14159. Next."]),
    ('"Really?!" she asked... Yes. "Fine."', 15, ['"Really?!"', "she asked...", 'Yes. "Fine."']),
    ("你好。今天天气很好！我们去公园吧？", 21, ["你好。", "今天天气很好！", "我们去公园吧？"]),  # CJK weighs 3
    ("我们去公园；然后回家，吃饭。", 21, ["我们去公园；", "然后回家，", "吃饭。"]),
    ("Hello world. 你好世界。Mixed text here!", 16, ["Hello world.", "你好世界。", "Mixed text here!"]),
    ("one two three four five six seven eight nine ten", 20, ["one two three four", "five six seven",
                                                               "eight nine ten"]),  # equal shares at spaces
    ("First paragraph.\n\nSecond one.", 200, ["First paragraph.", "Second one."]),
    # a sentence without a letter or digit is no generation of its own (each was one: 5 s of babble); beside words
    # in a segment it is read with them
    ("Chapter one.\n\n***\n\nIt was dark.", 200, ["Chapter one.", "It was dark."]),
    ("Wait.\n\n\u2014\n\n\u200b\n\n\U0001F600\n\nGo.", 200, ["Wait.", "Go."]),
    ("Yes. ... No.", 200, ["Yes. ... No."]),
    ("\u200b\u200b", 200, []),
    ("1.\n\nA.", 200, ["1.", "A."]),  # a digit is said
]


@pytest.mark.parametrize("text,max_chars,expected", CASES)
def test_cases(text, max_chars, expected):
    segments = split_text(text, max_chars)
    assert [s.text for s in segments] == expected
    assert all(text[s.start:s.end] == s.text for s in segments)
    assert [s.index for s in segments] == list(range(len(segments)))
    assert not segments or segments[-1].pause == "none"
    live = LiveSegmenter(max_chars)  # the live segmenter (which does not pack) speaks the same words
    fed = [seg for ch in text for seg in live.feed(ch)] + live.done()
    assert all(text[s.start:s.end] == s.text for s in fed)
    assert re.findall(r"\w+", " ".join(s.text for s in fed)) == re.findall(r"\w+", " ".join(expected))


def test_pauses_mark_sentences_and_paragraphs():
    s = split_text("One. Two.\n\nThree, four five six seven.", 10)
    assert [(x.text, x.pause) for x in s] == [("One. Two.", "paragraph"), ("Three,", "none"),
                                              ("four five", "none"), ("six seven.", "none")]


def test_no_punctuation_and_a_2000_character_sentence():
    words = " ".join(f"word{i}" for i in range(400))  # ~2,700 characters, no punctuation at all
    segments = split_text(words, 250)
    assert all(weight(s.text) <= 250 for s in segments) and len(segments) >= 11
    assert " ".join(s.text for s in segments) == words  # cut at spaces only
    long = ("and then, " * 200).strip()[:-1] + "."  # one 2,000-character sentence of clauses
    segments = split_text(long, 250)
    assert all(weight(s.text) <= 250 and s.text.endswith((",", ".")) for s in segments)
    assert all(long[s.start:s.end] == s.text for s in segments)


def test_hard_cut_and_cjk_weight():
    assert [len(s.text) for s in split_text("a" * 130, 60)] == [43, 43, 44]  # equal shares, no tiny tail
    cjk = split_text("一" * 130, 60)  # a CJK character weighs 3: 20 per segment at most
    assert all(weight(s.text) <= 60 for s in cjk) and "".join(s.text for s in cjk) == "一" * 130


def test_short_tail_merges():
    segments = split_text("A sentence of some length here. " * 3 + "Ok.", 100)
    assert segments[-1].text.endswith("here. Ok.")


def test_clause_granularity_fills_segments():
    text = "One, two, three. Four, five, six."
    assert [s.text for s in split_text(text, 12, "clause")] == ["One, two,", "three. Four,", "five, six."]
    assert [s.text for s in split_text(text, 12, "sentence")] == ["One, two,", "three.", "Four,", "five, six."]


def test_live_segmenter_waits_for_the_next_word():
    text = "Dr. Smith paid $3.14 e.g. for tea. Then he left. 你好。再见"
    live = LiveSegmenter(200)
    out = []
    for word in text.split(" "):
        got = live.feed(word + " ")
        assert all(s.text != "Dr." and not s.text.endswith("e.g.") for s in got)
        out += got
    assert [s.text for s in out] == ["Dr. Smith paid $3.14 e.g. for tea.", "Then he left.", "你好。"]
    out += live.done()
    assert [s.text for s in out][-1] == "再见" and all(text[s.start:s.end] == s.text for s in out)


def test_live_flush_speaks_the_buffer():
    live = LiveSegmenter(200)
    assert live.feed("no boundary yet") == []
    flushed = live.flush()
    assert [s.text for s in flushed] == ["no boundary yet"] and live.feed(" more") == []
    assert [(s.text, s.start) for s in live.done()] == [("more", 16)]


def test_a_cut_never_falls_inside_a_number_or_a_time():
    """A long sentence is cut at clause marks followed by space, not at the comma of 1,234,567 or the colon of 10:45."""
    text = "We paid a total of 1,234,567,890 dollars for the building at 10:45 in the morning, " * 4
    segments = split_text(text, 100)
    assert len(segments) > 1
    for seg in segments:
        assert not seg.text[-1:].isdigit() and not text[seg.end:seg.end + 1].isdigit(), seg


def test_a_long_sentence_without_marks_is_cut_into_pieces_that_cover_it():
    """100,000 CJK characters with no mark (the longest text a request may have): pieces of at most max_chars weight
    that cover the text exactly (the cuts are found in a window each, not by re-reading the rest)."""
    text = "字" * 100_000
    segments = split_text(text, 250)
    assert "".join(s.text for s in segments) == text
    assert max(weight(s.text) for s in segments) <= 250 * 3 // 2


def test_live_white_space_is_read_once():
    """A session sending only line breaks keeps no buffer (each message would re-read it all), and the offsets
    after it still point into the whole text."""
    live = LiveSegmenter(200)
    for _ in range(1000):
        assert live.feed("\n") == []
    assert live.buffer == ""
    assert [(s.text, s.start) for s in live.feed("Hello. ") + live.done()] == [("Hello.", 1000)]


def test_live_flush_mid_sentence_adds_no_pause():
    """A flush that cuts a sentence (or a word) pauses for nothing; one after a sentence's end, as a sentence."""
    live = LiveSegmenter(200)
    live.feed("Hel")
    assert [(s.text, s.pause) for s in live.flush()] == [("Hel", "none")]
    assert [(s.text, s.pause) for s in live.feed('lo. She said "yes."')] == [("lo.", "sentence")]
    assert [(s.text, s.pause) for s in live.flush()] == [('She said "yes."', "sentence")]


def test_clause_cuts_follow_closing_guillemets_and_cjk_brackets():
    text = "«Bonjour, mon ami,» dit-il lentement, «comment allez-vous?»"
    assert [s.text for s in split_text(text, 20, "clause")][:2] == ["«Bonjour, mon ami,»", "dit-il lentement,"]


@pytest.mark.parametrize("text", ["Hello, A\u00a0. B", "Plan B\u00a0. Next.", "I\u3000.", "ok\u2009. fine",
                                  "x\u202f. Yes.", "Para one.\n\nPara\u00a0two. End."])
def test_wide_spaces_before_a_period_are_split_like_spaces(text):
    """sentencex panicked on a letter, a no-break (or other wide) space and a period (a 500 on every route); the text
    is now read with a plain space there, its offsets its own."""
    segments = split_text(text, 250)
    spaced = split_text(text.translate({c: " " for c in (0xA0, 0x3000, 0x2009, 0x202F)}), 250)
    assert [(s.start, s.end, s.pause) for s in segments] == [(s.start, s.end, s.pause) for s in spaced]
    assert segments and all(text[s.start:s.end] == s.text for s in segments)
    live = LiveSegmenter(250)
    fed = [seg for ch in text for seg in live.feed(ch)] + live.done()
    assert [s.text for s in fed] and all(text[s.start:s.end] == s.text for s in fed)


@pytest.mark.parametrize("text", ["Hi there. " + "\u200b" * 600 + " ok.", "Hi " + "*" * 600, "a" + "*" * 99_999],
                         ids=["zero-width", "asterisks", "one-letter"])
def test_pieces_of_a_cut_sentence_without_words_are_no_segments(text):
    """A long run of characters with nothing to say inside a sentence, once cut, gave segments of it alone (each a
    generation to the length cap: 966 s of audio from 614 characters); those pieces are left out, in either
    granularity, and the text's last segment still ends it."""
    for granularity in ("sentence", "clause"):
        segments = split_text(text, 250, granularity)
        assert segments and all(re.search(r"\w", s.text) for s in segments), segments
        assert sum(weight(s.text) for s in segments) <= 2 * 250 and segments[-1].pause == "none"


def test_live_text_without_words_is_not_read_again_and_makes_no_segment(monkeypatch):
    """A session sending 20,000 word-less messages: the sentence splitter is not run on its growing buffer (each
    message re-read it all: quadratic); the words after them make segments with words only."""
    import service.segmenter as segmenter

    scans: list[int] = []
    sentences = segmenter._sentences
    monkeypatch.setattr(segmenter, "_sentences", lambda text, base=0: scans.append(len(text)) or sentences(text, base))
    live = LiveSegmenter(250)
    for _ in range(20_000):
        assert live.feed("-") == []
    assert scans == []
    segments = live.feed(" ok. ") + live.feed("Next.") + live.done()
    assert segments and all(re.search(r"\w", s.text) for s in segments), segments
    assert sum(scans) < 10 * 20_000  # a few reads of the buffer, not one per message


def test_live_unpunctuated_text_makes_full_segments():
    """Words streamed without a sentence end: each segment cut from the growing sentence is about max_chars long
    (cut into halves as soon as it passed max_chars, it made twice the segments of the same text sent at once)."""
    live = LiveSegmenter(250)
    segments = [s for _ in range(300) for s in live.feed("word ")] + live.done()
    assert all(200 <= weight(s.text) <= 250 for s in segments[:-1]), [len(s.text) for s in segments]
    assert len(segments) <= len(split_text("word " * 300, 250)) + 1


def test_a_hard_cut_in_cjk_text_falls_beside_a_latin_word_not_inside_it():
    """CJK text with no mark or space: the cut falls between characters, but never inside an embedded Latin word or
    number ("Py" | "Torch" was spoken as two words)."""
    for n in range(60, 140, 7):
        text = "字" * n + "PyTorch2024" + "字" * n
        segments = split_text(text, 100)
        assert "".join(s.text for s in segments) == text
        assert any("PyTorch2024" in s.text for s in segments), [s.text[-12:] for s in segments]


def test_live_text_without_words_does_not_pile_up_to_be_read_at_every_message():
    """Text without words behind a sentence that waits for the next to begin piled up (100,000 characters of "! "),
    and every message, an empty one too, read all of it again (7.5 ms each, without end): past four max_chars what is
    buffered is spoken; an empty message reads nothing."""
    live = LiveSegmenter(250)
    assert live.feed("a.") == []
    spoken: list = []
    for _ in range(200):
        spoken += live.feed("! " * 25)
        assert len(live.buffer) <= 4 * 250 + 50  # bounded: what one message reads
    assert [s.text for s in spoken] == ["a.!"] and spoken[0].start == 0
    buffered = live.buffer
    assert live.feed("") == [] and live.buffer == buffered
    assert [s.text for s in live.feed("Hello there. How")] == ["Hello there."]


@pytest.mark.parametrize("blank", ["\n\n", "\n \n", "\r\n \r\n", "\n\t\n", "\n  \t \n\n"])
def test_a_blank_line_with_spaces_is_a_paragraph_break(blank):
    """A blank line that holds spaces or tabs (or a Windows line end) breaks the paragraph as an empty one does: the
    two paragraphs were packed into one segment without a pause, and the live path paused for a sentence."""
    first, second = "First paragraph, sentence one. Sentence two.", "Second paragraph here. And more."
    segments = split_text(first + blank + second, 250)
    assert [s.text for s in segments] == [first, second] and segments[0].pause == "paragraph"
    live = LiveSegmenter(250)
    spoken = live.feed(first + blank + second) + live.done()
    (end_of_first,) = [s for s in spoken if s.text.endswith("Sentence two.")]  # live segments are sentences
    assert end_of_first.pause == "paragraph", spoken
