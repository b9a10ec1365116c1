"""Text normalisation (`normalize: true`): a table of English and Chinese written forms against what is spoken, the
text and token ids left exactly as they were when it is off, and over real HTTP that a normalised request speaks
the written-out words."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from engine.io.tokenizer import TextTokenizer, text_tokens
from service.normalize import normalize, normalize_target
from service.schemas import GenerateRequest, SpeechRequest
from tests.service_harness import TLS, live_server

CASES = [
    # cardinals, decimals, ordinals
    ("I have 3 apples.", "I have three apples."),
    ("1,234,567 people", "one million two hundred thirty four thousand five hundred and sixty seven people"),
    ("pi is 3.14", "pi is three point one four"),
    ("He came 1st, she 2nd, 21st.", "He came first, she second, twenty first."),
    ("The 1990s.", "The nineteen nineties."),
    ("version 2.0.1", "version two dot zero dot one"),
    # currency
    ("It costs $3.50.", "It costs three dollars and fifty cents."),
    ("$1 and $1.01", "one dollar and one dollar and one cent"),
    ("¥20 or €5 or £7.25", "twenty yen or five euros or seven pounds and twenty five pence"),
    ("$1,234.56", "one thousand two hundred thirty four dollars and fifty six cents"),
    ("$2.5 million", "two point five million dollars"),
    # dates
    ("On 2025-09-28 we met.", "On the twenty eighth of september twenty twenty five we met."),
    ("On 09/28/2025 we met.", "On the twenty eighth of september twenty twenty five we met."),
    ("September 28, 2025", "the twenty eighth of september, twenty twenty five"),
    # times, units, percentages
    ("At 3:45 pm and 14:30.", "At three forty five P M and fourteen thirty."),
    ("Run 5 km and lift 3 kg.", "Run five kilometers and lift three kilograms."),
    ("Up 25% today.", "Up twenty five percent today."),
    # phone numbers
    ("Call 555-123-4567.", "Call five five five, one two three, four five six seven."),
    ("Call +44 20 7946 0958 now", "Call plus four four, two zero, seven nine four six, zero nine five eight now"),
    # the grammars' escaping undone (quotes and backslashes reach the model as written); centuries; a version after a
    # word
    ('She said "I have 5 cats" to me.', 'She said "I have five cats" to me.'),
    ("A back\\slash and 3 dogs.", "A back\\slash and three dogs."),
    ("The 1900s and the 2000s.", "The nineteen hundreds and the two thousands."),
    ("Use v2.0.1 now.", "Use v two dot zero dot one now."),
    # words in capitals: spoken when pronounceable, spelled when not, shouting read as words
    ("The NASA and FBI and the USA.", "The nasa and F B I and the U S A."),
    ("HTML over HTTP", "H T M L over H T T P"),
    ("HELLO WORLD, I LOVE YOU AND THE FBI.", "hello world, I love you and the F B I."),
    # shouting is a sentence's, not its neighbours' (they were spelled: "W E A R E G O")
    ("WE ARE GO. This is a long and calm sentence after it.", "we are go. This is a long and calm sentence after it."),
    ("This is a long and calm sentence first. WE ARE GO.", "This is a long and calm sentence first. we are go."),
    ("World War II", "World War two"),
    # Chinese
    ("我有3个苹果。", "我有三个苹果。"),
    ('他说"我有3个苹果"。', '他说"我有三个苹果"。'),
    ("反斜杠\\\\两个", "反斜杠\\\\两个"),  # a run the grammar passes through keeps its backslashes
    ("价格是¥20", "价格是二十元"),
    ("今天是2025-09-28", "今天是二零二五年九月二十八日"),
    ("2025年9月28日", "二零二五年九月二十八日"),
    ("日期09/28/2025", "日期二零二五年九月二十八日"),
    ("下午3:45", "下午三点四十五分"),
    ("14:30开会", "十四点三十分开会"),
    ("跑了5km，重3kg", "跑了五公里，重三千克"),
    ("增长了25%", "增长了百分之二十五"),
    ("电话13812345678", "电话幺三八幺二三四五六七八"),
    ("电话+86 138 1234 5678", "电话加八六幺三八幺二三四五六七八"),
    ("GPT-4很强", "G P T 四很强"),
    ("1年期LPR为3.0%", "一年期L P R为百分之三点零"),
    # signs and currencies the grammar failed on (each kept its run as written, digits spelled: "+three.five%")
    ("Up +3.5% today.", "Up plus three point five percent today."),
    ("It fell \u22123.5%.", "It fell minus three point five percent."),
    ("\u22125\u00b0C", "negative five degrees Celsius"),
    ("$-3.50 or -$3.50", "minus three dollars and fifty cents or minus three dollars and fifty cents"),
    ("50\u00a2 and 1\u00a2", "fifty cents and one cent"),
    ("\u20a91000 and \u20b9500.50", "one thousand won and five hundred rupees and fifty paise"),
    ("10\u00a0000 people and 1\u202f250\u202f000 more", "ten thousand people and one million two hundred fifty "
                                                         "thousand more"),  # was "ten oh oh zero people"
    # a word the grammar still fails on is kept as written, not the rest of its run with it
    ("I paid $3 on 2025-09-28, #5 of 25% more.", "I paid three dollars on the twenty eighth of september twenty "
                                                "twenty five, #five of twenty five percent more."),
    # mixed: an English phrase inside Chinese is read in English, a lone number by the Chinese grammar
    ("他说：I have 3 apples and $5.", "他说：I have three apples and five dollars."),
    ("我喜欢 New York 的 3 个公园", "我喜欢 New York 的 三个公园"),
    # an amount's magnitude as a letter, and the metre ("one dollar and twenty centsB", "one point eight minutes")
    ("Revenue of $1.2B.", "Revenue of one point two billion dollars."), ("$5M budget", "five million dollars budget"),
    ("$2.5bn deal", "two point five billion dollars deal"), ("$3K bonus", "three thousand dollars bonus"),
    ("He is 1.8 m tall.", "He is one point eight metres tall."), ("100m race", "one hundred metres race"),
    ("30 m/s", "thirty metres per second"), ("1 m", "one metre"), ("5 min late", "five minutes late"),
    # not a magnitude, not the metre; Chinese with a middle dot or full-width capitals (left unread a while)
    ("A $10 T-shirt.", "A ten dollars T-shirt."), ("$5 K-cup", "five dollars K-cup"), ("50 m²", "fifty square meters"),
    ("迈克尔・杰克逊在2009年去世，享年50岁。", "迈克尔・杰克逊在二零零九年去世，享年五十岁。"),
    ("第3季度ＧＤＰ增长5%。", "第三季度ＧＤＰ增长百分之五。"),
]


@pytest.mark.parametrize(("written", "spoken"), CASES, ids=[c[0] for c in CASES])
def test_spoken_forms(written, spoken):
    assert normalize(written) == spoken


# Years and decades as people say them: in pairs, "oh" for a 0 in the tens, "two thousand" for 2000-2009.
YEARS = [
    ("the 2000s", "the two thousands"),
    ("the 2010s", "the twenty tens"),
    ("the 2020s", "the twenty twenties"),
    ("the 1900s", "the nineteen hundreds"),
    ("the 1990s", "the nineteen nineties"),
    ("the 1800s", "the eighteen hundreds"),
    ("the 2100s", "the twenty one hundreds"),
    ("in 2005", "in two thousand five"),
    ("in 2000", "in two thousand"),
    ("in 1905", "in nineteen oh five"),
    ("in 1001", "in ten oh one"),
    ("in 2105", "in twenty one oh five"),
    ("in 2020", "in twenty twenty"),
    ("in 2019", "in twenty nineteen"),
    ("in 1999", "in nineteen ninety nine"),
    ("in 1900", "in nineteen hundred"),
    ("from 1809 to 1909", "from eighteen oh nine to nineteen oh nine"),
    ("May 1905", "May nineteen oh five"),
    ("On 1905-09-28 we met.", "On the twenty eighth of september nineteen oh five we met."),
    ("September 28, 2005", "the twenty eighth of september, two thousand five"),
    # not years: left as they were
    ("19050 cats", "nineteen thousand and fifty cats"),
    ("190.5 cats", "one hundred and ninety point five cats"),
    ("3005 cats", "three thousand and five cats"),
    ("at 19:05", "at nineteen o five"),
    # 1,000-1,999 and such decimals with their "one" (the grammar drops it)
    ("It cost 1,905 dollars.", "It cost one thousand nine hundred and five dollars."),
    ("1,001 nights", "one thousand one nights"),
    ("It weighs 1905.5 kg.", "It weighs one thousand nine hundred and five point five kilograms."),
    ("1,050 km", "one thousand fifty kilometers"),
    # 1000-2999 alone: a year where the context says so, else a quantity (the grammar read every one as a year)
    ("about 1234 sheep", "about one thousand two hundred and thirty four sheep"),
    ("We sold 2500 tickets.", "We sold two thousand five hundred tickets."),
    ("It weighs 1500 kg.", "It weighs one thousand five hundred kilograms."),
    ("between 1000 and 2000 people", "between one thousand and two thousand people"),
    ("In 1999, we moved.", "In nineteen ninety nine, we moved."),
    ("1999 was a good year.", "nineteen ninety nine was a good year."),
    ("He said: 1984 is a book.", "He said: nineteen eighty four is a book."),
    ("Born September 28, 1905 in Paris.", "Born the twenty eighth of september, nineteen oh five in Paris."),
    ("around 1200 AD", "around twelve hundred A D"),
    # a unit after it makes it a quantity in a year's context; a label before it keeps the pairs
    ("in 1500 meters", "in one thousand five hundred meters"),
    ("In 1500 km we stop.", "In one thousand five hundred kilometers we stop."),
    ("in 1500 square meters", "in one thousand five hundred square meters"),
    ("in 1500 years", "in fifteen hundred years"),
    ("In 1923 W. B. Yeats won.", "In nineteen twenty three W B Yeats won."),
    ("Report by 1900 hours.", "Report by nineteen hundred hours."),
    ("In 1969 times were different.", "In nineteen sixty nine times were different."),
    ("In 1905 people left.", "In nineteen oh five people left."),
    ("in 2010 dollars", "in twenty ten dollars"),
    ("Room 1905 is upstairs.", "Room nineteen oh five is upstairs."),
    ("We took flight 1234.", "We took flight twelve thirty four."),
    # 1000 itself, units after these numbers, ranges, a comma after them
    ("He scored 1,000 points", "He scored one thousand points"),
    ("1000 points", "one thousand points"),
    ("1,000 km/h", "one thousand kilometers per hour"),
    ("1000.5 km", "one thousand point five kilometers"),
    ("1,000x", "one thousand times"),
    ("1,200-1,500", "one thousand two hundred to one thousand five hundred"),
    ("1,200 - 1,500", "one thousand two hundred to one thousand five hundred"),
    ("In 1905, he left.", "In nineteen oh five, he left."),
    ("We have 1,500, they have 1,600.", "We have one thousand five hundred, they have one thousand six hundred."),
    ("two thousand point five", "two thousand point five"),
    ("2,500 people", "two thousand five hundred people"),
    ("1,234,567 people", "one million two hundred thirty four thousand five hundred and sixty seven people"),
]


@pytest.mark.parametrize(("written", "spoken"), YEARS, ids=[c[0] for c in YEARS])
def test_years_and_decades(written, spoken):
    assert normalize(written) == spoken


def test_voice_design_description_and_edges_are_kept():
    assert normalize_target("(a calm, slow voice with 2 pauses)I have 3 apples") == \
        "(a calm, slow voice with 2 pauses)I have three apples"
    assert normalize("  I have 3 apples  ") == "  I have three apples  "
    assert normalize("   ") == "   "


def test_long_text_is_normalised_whole_and_threads_agree():
    sentence = "On 2025-09-28 I paid $3.50 for 3 apples. "
    text = sentence * 60  # cut into pieces inside; the result is the pieces' results joined
    expected = normalize(sentence).rstrip() + " "
    out: list[str] = []
    threads = [threading.Thread(target=lambda: out.append(normalize(text))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == [expected * 60] * 4


def test_off_by_default_leaves_text_and_token_ids_unchanged(checkpoint_factory):
    assert GenerateRequest(target_text="x").normalize is False
    assert SpeechRequest(model="voxcpm", input="x").normalize is False
    tok = TextTokenizer.from_dir(checkpoint_factory("tiny-voxcpm2", stop="never"))
    written, spelled = "I have 3 apples on 2025-09-28.", "I have three apples on the twenty eighth of september"
    # off: the engine gets the request's own string, so its ids are today's
    assert text_tokens(tok, written, "", False)[0] == tok.encode(written)
    on = normalize(written)
    assert on.startswith(spelled) and text_tokens(tok, on, "", False)[0] != tok.encode(written)


@pytest.fixture(scope="module")
def client(checkpoint_factory, tmp_path_factory):
    with live_server(checkpoint_factory, tmp_path_factory.mktemp("svc-normalize")) as s, \
            httpx.Client(verify=TLS, base_url=s.url, timeout=120) as c:
        yield c


def _pcm(client: httpx.Client, route: str, body: dict) -> np.ndarray:
    r = client.post(route, json={"response_format": "pcm", "seed": 7, "max_generate_length": 3, **body})
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, "<i2")


@pytest.mark.parametrize(("route", "field", "extra"), [("/generate", "target_text", {}),
                                                         ("/v1/audio/speech", "input", {"model": "voxcpm"})])
def test_normalize_true_speaks_the_words(client, route, field, extra):
    def speak(text: str, **flag: bool) -> np.ndarray:
        return _pcm(client, route, {field: text, **extra, **flag})

    digits = speak("I have 3 apples", normalize=True)
    assert np.array_equal(digits, speak("I have three apples", normalize=False))
    assert not np.array_equal(digits, speak("I have 3 apples"))  # default: spoken as written


@pytest.mark.parametrize(("written", "spoken"), [
    ("9999999999999999 cats", "nine nine nine nine nine nine nine nine nine nine nine nine nine nine nine nine cats"),
    ("a  b", "a b"),  # the grammar fails on runs of spaces; the engine collapses them anyway
    ("٣ apples", "٣ apples"),  # digits of other scripts are left as written
    ("x " * 400, "x " * 400),  # long text without punctuation is cut between words, never failed
    ("x" * 450, "x" * 450),  # a word longer than a piece is cut every 200 characters (the grammar's cost grows faster)
    # other scripts are left as written (the English grammar read "У меня three яблока", "three개가")
    ("У меня 3 яблока.", "У меня 3 яблока."), ("مرحبا 123 بالعالم", "مرحبا 123 بالعالم"),
    ("저는 사과 3개가 있어요.", "저는 사과 3개가 있어요."), ("りんごが3つあります。", "りんごが3つあります。"),
])
def test_odd_input_is_spoken_or_kept_never_failed(written, spoken):
    assert normalize(written) == spoken


def test_pieces_stay_short_whatever_the_text():
    """What the grammar matches at a time (holding the GIL: the event loop waits) stays about 200 characters, also in
    a text without a space: "1.1.1..." went whole (2.9 s for 4,000 characters, 0.9 s in pieces)."""
    from service.normalize import _CHUNK_CHARS, _chunks

    for text in ("1." * 2000, "x" * 450, "Short. " * 100, "a, " * 300):
        pieces = _chunks(text)
        assert "".join(pieces) == text and max(map(len, pieces)) <= _CHUNK_CHARS, text[:20]


def test_the_normalisation_process_gives_normalize_and_outlives_its_child():
    """The service normalises in a child process (off its GIL): the same words as `normalize`, and a child that died
    is replaced on the next call."""
    import asyncio
    import os
    import signal

    from service.normalize_process import NormalizeProcess

    normalizer = NormalizeProcess()

    async def calls() -> tuple[str, str, int, int]:
        first = await normalizer(normalize_target, "(calm)I paid $3.50.")
        child = next(iter(normalizer._pool._processes))  # the executor's one process
        os.kill(child, signal.SIGKILL)
        await asyncio.sleep(0.2)
        again = await normalizer(normalize, "I have 3 apples.")
        return first, again, child, next(iter(normalizer._pool._processes))

    try:
        first, again, child, replaced = asyncio.run(calls())
    finally:
        normalizer.close()
    assert first == "(calm)I paid three dollars and fifty cents." and again == "I have three apples."
    assert child != os.getpid() and replaced != child


def test_a_wedged_normalisation_process_is_killed_and_the_text_spoken_as_written():
    """A child that gives no answer (stopped here) held every normalising request of its API process for good: past
    the deadline it is killed, the text is spoken as written (as where a grammar fails), and the next call has a
    new child."""
    import asyncio
    import os
    import signal

    import psutil

    from service.normalize_process import NormalizeProcess

    normalizer = NormalizeProcess(timeout_s=2.0)

    async def calls() -> tuple[str, str, int]:
        await normalizer(normalize, "I have 3 apples.")  # the child is up
        child = next(iter(normalizer._pool._processes))
        os.kill(child, signal.SIGSTOP)
        wedged = await normalizer(normalize, "I have 4 pears.")
        again = await normalizer(normalize, "I have 5 plums.")
        return wedged, again, child

    try:
        wedged, again, child = asyncio.run(calls())
    finally:
        normalizer.close()
    assert wedged == "I have 4 pears." and again == "I have five plums."
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def _slow_normalize(text: str) -> str:
    """`normalize`, taking 0.8 s more (in the normalisation child)."""
    import time

    time.sleep(0.8)
    return normalize(text)


def test_calls_queued_behind_others_are_not_timed_out():
    """The deadline is a call's own work: six healthy 0.8 s calls at once with a 2.5 s deadline are each normalised
    (timed from their queueing, the later ones came back as written and the healthy child was killed)."""
    import asyncio

    from service.normalize_process import NormalizeProcess

    normalizer = NormalizeProcess(timeout_s=2.5)

    async def calls() -> list[str]:
        await normalizer(_slow_normalize, "warm up 1")  # the child imports this module once
        return await asyncio.gather(*(normalizer(_slow_normalize, f"I have {i} apples.") for i in range(2, 8)))

    try:
        spoken = asyncio.run(calls())
    finally:
        normalizer.close()
    assert spoken == [f"I have {w} apples." for w in ("two", "three", "four", "five", "six", "seven")]


def _wedging_normalize(text: str) -> str:
    """`normalize`, but a text "wedge" never comes back (in the normalisation child)."""
    import time

    if text == "wedge":
        time.sleep(600)
    return normalize(text)


def test_a_text_that_wedges_a_new_child_holds_it_only_a_calls_deadline():
    """A new child's start-up has its own allowance (a call of its own): a wedging text sent again after a kill held
    the new child, and every call behind it, for the start-up allowance too (130 s, not 10)."""
    import asyncio
    import time

    from service.normalize_process import NormalizeProcess

    normalizer = NormalizeProcess(timeout_s=1.0)

    async def calls() -> tuple[str, float, str]:
        await normalizer(_wedging_normalize, "warm 1")
        assert await normalizer(_wedging_normalize, "wedge") == "wedge"  # killed after its second
        started = time.monotonic()
        again = await normalizer(_wedging_normalize, "wedge")  # a new child: its start, then the call's second
        return again, time.monotonic() - started, await normalizer(_wedging_normalize, "I have 3 apples.")

    try:
        again, took, after = asyncio.run(calls())
    finally:
        normalizer.close()
    assert again == "wedge" and took < 30, took
    assert after == "I have three apples."
