"""Tokenizer, chat format and streaming detokenization (spec §F) on the real V4 tokenizer."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.chat import (
    BOS_TOKEN,
    EOS_TOKEN,
    MAX_HELD_IDS,
    ChatFormatError,
    ChatTokenizer,
    IncrementalDetokenizer,
    Message,
    ThinkingSplitter,
    TokenizerError,
    bundled_tokenizer_dir,
    parse_completion,
    render_messages,
)
from engine.events import TextDelta

B, E = BOS_TOKEN, EOS_TOKEN
U, A = "<｜User｜>", "<｜Assistant｜>"
HARD_TEXT = "naïve café — 中文字符 😀👍🏽 日本語 ½ 🇫🇷 Ελληνικά 𝔘𝔫𝔦"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(bundled_tokenizer_dir())


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Every push output, then the flush output."""
    return [detok.push(i) for i in ids] + [detok.flush()]


# --- files and special tokens (§F.1) ------------------------------------------------------


def test_bundled_files_are_the_official_ones():
    data = (bundled_tokenizer_dir() / "tokenizer.json").read_bytes()
    assert hashlib.sha256(data).hexdigest().startswith("8f9f37ca")


def test_special_token_ids(tok):
    assert (tok.bos_id, tok.eos_id, tok.user_id, tok.assistant_id) == (0, 1, 128803, 128804)
    assert (tok.think_start_id, tok.think_end_id) == (128821, 128822)
    assert tok.vocab_size == 129280
    table = {
        "<｜▁pad▁｜>": 2, "｜DSML｜": 128825, "<｜latest_reminder｜>": 128828,
        "<｜action｜>": 128829, "<｜query｜>": 128830, "<｜authority｜>": 128831,
        "<｜domain｜>": 128832, "<｜title｜>": 128836, "<｜extracted_url｜>": 128844,
        "<｜read_url｜>": 128845,
    }
    assert {s: tok.token_id(s) for s in table} == table
    assert len(tok.encode("<tool_result>")) > 1  # ordinary text, not a special token


def test_golden_vectors(tok):
    assert tok.encode("Hello") == [19923]
    assert tok.decode([19923]) == "Hello"
    system_hi = [Message("system", "You are helpful."), Message("user", "Hi")]
    assert render_messages(system_hi, thinking=False) == f"{B}You are helpful.{U}Hi{A}</think>"
    assert tok.encode_messages(system_hi, thinking=False) == [
        0, 3476, 477, 11502, 16, 128803, 23166, 128804, 128822]
    three = [Message("user", "Hi"), Message("assistant", "Hello!"), Message("user", "2+2?")]
    expected = [0, 128803, 23166, 128804, 128822, 19923, 3, 1, 128803, 20, 13, 20, 33, 128804]
    assert render_messages(three, thinking=False) == (
        f"{B}{U}Hi{A}</think>Hello!{E}{U}2+2?{A}</think>")
    assert tok.encode_messages(three, thinking=False) == expected + [128822]
    assert tok.encode_messages(three, thinking=True) == expected + [128821]


def test_encode_adds_no_bos_and_decode_keeps_specials(tok):
    assert tok.encode("Hi") == [23166]
    ids = tok.encode(f"{B}Hi{E}")
    assert ids == [0, 23166, 1]
    assert tok.decode(ids) == f"{B}Hi{E}"


# --- rendering (§F.2) -----------------------------------------------------------------------

HISTORY = [
    Message("system", "S"),
    Message("user", "u1"),
    Message("assistant", "a1", reasoning="r1"),
    Message("user", "u2"),
]


def test_render_chat_mode_ignores_reasoning():
    assert render_messages(HISTORY, thinking=False) == (
        f"{B}S{U}u1{A}</think>a1{E}{U}u2{A}</think>")
    assert render_messages(HISTORY, thinking=False, drop_thinking=False) == (
        f"{B}S{U}u1{A}</think>a1{E}{U}u2{A}</think>")


def test_render_thinking_mode_drops_earlier_reasoning():
    assert render_messages(HISTORY, thinking=True) == (
        f"{B}S{U}u1{A}</think>a1{E}{U}u2{A}<think>")


def test_render_thinking_mode_keeps_reasoning_without_drop():
    assert render_messages(HISTORY, thinking=True, drop_thinking=False) == (
        f"{B}S{U}u1{A}<think>r1</think>a1{E}{U}u2{A}<think>")


def test_render_thinking_completed_turn_is_prompt_plus_completion():
    turn = [Message("user", "u1"), Message("assistant", "a1", reasoning="r1")]
    prompt = render_messages(turn[:1], thinking=True)
    assert prompt == f"{B}{U}u1{A}<think>"
    assert render_messages(turn, thinking=True) == prompt + f"r1</think>a1{E}"
    # The next turn drops r1, so it does not extend the previous prompt (§D.3).
    nxt = render_messages([*turn, Message("user", "u2")], thinking=True)
    assert not nxt.startswith(prompt)


def test_render_consecutive_users_get_one_assistant_opener():
    msgs = [Message("user", "a"), Message("user", "b")]
    assert render_messages(msgs, thinking=False) == f"{B}{U}a{U}b{A}</think>"


def test_chat_mode_next_turn_extends_prompt_and_completion(tok):
    turns = [("Hi there", "Hello! How can I help? 😀"), ("2+2?", "4."), ("中文呢？", "可以。")]
    history: list[Message] = []
    for user, answer in turns:
        history.append(Message("user", user))
        prompt = render_messages(history, thinking=False)
        prompt_ids = tok.encode_messages(history, thinking=False)
        completion_ids = tok.encode(answer + E)  # what the model generates, EOS included
        history.append(Message("assistant", answer))
        nxt = [*history, Message("user", "next")]
        assert render_messages(nxt, thinking=False).startswith(prompt + answer + E)
        assert tok.encode_messages(nxt, thinking=False)[: len(prompt_ids) + len(completion_ids)] \
            == prompt_ids + completion_ids


def test_message_and_render_errors():
    with pytest.raises(ChatFormatError, match="unknown role 'tool'"):
        Message("tool", "x")
    with pytest.raises(ChatFormatError, match="user message cannot carry reasoning"):
        Message("user", "x", reasoning="r")
    with pytest.raises(ChatFormatError, match="empty message list"):
        render_messages([], thinking=False)


# --- parsing completions --------------------------------------------------------------------


def test_parse_completion_chat_mode(tok):
    assert parse_completion(f"Hello!{E}", thinking=False) == ("", "Hello!")
    assert parse_completion("cut off", thinking=False) == ("", "cut off")
    ids = tok.encode(f"中文 😀{E}")
    assert parse_completion(ids, thinking=False, tokenizer=tok) == ("", "中文 😀")


def test_parse_completion_thinking_mode():
    assert parse_completion(f"r1</think>a1{E}", thinking=True) == ("r1", "a1")
    tool_call = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
    assert parse_completion(f"r</think>answer{tool_call}", thinking=True) == ("r", "answer")
    assert parse_completion("still thinking", thinking=True) == ("still thinking", "")
    assert parse_completion(f"r{E}", thinking=True) == ("r", "")
    assert parse_completion("r</think>partial", thinking=True) == ("r", "partial")


def test_parse_completion_ids_need_a_tokenizer():
    with pytest.raises(ChatFormatError, match="no tokenizer"):
        parse_completion([19923, 1], thinking=False)


def test_render_then_parse_round_trip():
    prompt = render_messages([Message("user", "q")], thinking=True)
    turn = [Message("user", "q"), Message("assistant", "ans", reasoning="why")]
    full = render_messages(turn, thinking=True)
    assert parse_completion(full[len(prompt):], thinking=True) == ("why", "ans")


# --- incremental detokenizer ------------------------------------------------------------------


def test_detokenizer_reproduces_multibyte_text_without_replacement_chars(tok):
    ids = tok.encode(HARD_TEXT)
    outputs = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(outputs) == HARD_TEXT
    assert not any("\ufffd" in out for out in outputs)
    assert any(out == "" for out in outputs[:-1])  # some pieces really were held back


def test_detokenizer_holds_a_character_split_across_tokens(tok):
    head, tail = tok.encode(" 😀")  # 'Ġ' + first 3 bytes of U+1F600, then its last byte
    assert tok.decode([head]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(head) == " "
    assert detok.push(tail) == "😀"
    assert detok.flush() == ""


def test_detokenizer_special_tokens_are_atomic(tok):
    head, _ = tok.encode(" 😀")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.user_id) == U
    assert detok.push(head) == " "
    # A special token after an incomplete character: the broken bytes become one U+FFFD.
    assert detok.push(tok.eos_id) == "\ufffd" + E
    assert detok.push(tok.encode("ok")[0]) == "ok"
    ids = tok.encode(f"{B}{U}中文{A}</think>😀{E}")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == f"{B}{U}中文{A}</think>😀{E}"


def test_detokenizer_emits_invalid_bytes_once_they_are_known_invalid(tok):
    lead = tok.token_id("ä")  # the single byte 0xE4, a 3-byte lead
    detok = IncrementalDetokenizer(tok)
    assert detok.push(lead) == ""  # may still become a character
    assert detok.push(lead) == "\ufffd"  # a lead after a lead: the first one is broken
    assert detok.flush() == "\ufffd"


class CountingTokenizer:
    """Duck-typed ChatTokenizer that records the number of ids of every decode call."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self._tok = tok
        self.added_token_ids = tok.added_token_ids
        self.lengths: list[int] = []

    def decode(self, ids):
        self.lengths.append(len(ids))
        return self._tok.decode(ids)


def test_detokenizer_decodes_a_short_window_per_token(tok):
    counting = CountingTokenizer(tok)
    ids = tok.encode(HARD_TEXT * 40)
    assert len(ids) > 1000
    assert "".join(stream(IncrementalDetokenizer(counting), ids)) == HARD_TEXT * 40
    assert max(counting.lengths) <= 5
    assert len(counting.lengths) <= 2 * len(ids) + 1


def test_detokenizer_bounds_the_held_window(tok):
    stray = tok.token_id("Ģ")  # the single byte 0x80, a continuation byte with no lead
    counting = CountingTokenizer(tok)
    outputs = stream(IncrementalDetokenizer(counting), [stray] * 200)
    assert "".join(outputs) == "\ufffd" * 200
    assert outputs[0] == ""  # a trailing U+FFFD is held back until the next id
    assert max(counting.lengths) == MAX_HELD_IDS + 1


unicode_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(text=unicode_text)
def test_detokenizer_property_text(tok, text):
    outputs = stream(IncrementalDetokenizer(tok), tok.encode(text))
    assert "".join(outputs) == text
    assert not any("\ufffd" in out for out in outputs)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(
    st.one_of(st.integers(0, 127999), st.sampled_from([0, 1, 128803, 128821, 128822])),
    max_size=MAX_HELD_IDS))
def test_detokenizer_property_any_ids_match_full_decode(tok, ids):
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == tok.decode(ids)


# --- thinking splitter ------------------------------------------------------------------------


def collect(splitter: ThinkingSplitter, ids: list[int]) -> list[TextDelta]:
    deltas = [d for i in ids for d in splitter.push(i)]
    return deltas + splitter.flush()


def joined(deltas: list[TextDelta], channel: str) -> str:
    return "".join(d.text for d in deltas if d.channel == channel)


def test_thinking_splitter_routes_reasoning_and_answer(tok):
    ids = tok.encode(f"Let me think: 中文 😀</think>Answer 👍🏽{E}")
    assert tok.think_end_id in ids
    splitter = ThinkingSplitter(tok, thinking=True)
    assert splitter.channel == "thinking"
    deltas = collect(splitter, ids)
    assert joined(deltas, "thinking") == "Let me think: 中文 😀"
    assert joined(deltas, "answer") == "Answer 👍🏽"
    assert splitter.channel == "answer"
    assert all(d.text and "\ufffd" not in d.text for d in deltas)


def test_thinking_splitter_chat_mode_is_all_answer(tok):
    ids = tok.encode("Hi 中文") + [tok.think_end_id] + tok.encode(f"more{E}")
    deltas = collect(ThinkingSplitter(tok, thinking=False), ids)
    assert [d.channel for d in deltas] == ["answer"] * len(deltas)
    assert joined(deltas, "answer") == "Hi 中文more"


def test_thinking_splitter_flushes_held_bytes_into_the_thinking_channel(tok):
    head, _ = tok.encode(" 😀")
    splitter = ThinkingSplitter(tok, thinking=True)
    assert splitter.push(head) == [TextDelta(" ", "thinking")]
    assert splitter.push(tok.think_end_id) == [TextDelta("\ufffd", "thinking")]
    assert splitter.push(tok.encode("x")[0]) == [TextDelta("x", "answer")]


# --- errors -------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match=r"tokenizer directory .*nope does not exist"):
        ChatTokenizer.from_dir(missing)


def test_missing_files(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is missing"):
        ChatTokenizer.from_dir(tmp_path)
    shutil.copy(bundled_tokenizer_dir() / "tokenizer.json", tmp_path)
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json is missing"):
        ChatTokenizer.from_dir(tmp_path)


def test_unreadable_files(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "tokenizer.json").write_text("{}", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json is not readable JSON"):
        ChatTokenizer.from_dir(tmp_path)
    shutil.copy(bundled_tokenizer_dir() / "tokenizer_config.json", tmp_path)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is not a readable tokenizers file"):
        ChatTokenizer.from_dir(tmp_path)


def test_wrong_special_tokens(tmp_path):
    shutil.copy(bundled_tokenizer_dir() / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": E}), encoding="utf-8")
    with pytest.raises(TokenizerError, match="'bos_token' is missing"):
        ChatTokenizer.from_dir(tmp_path)
    config = {"bos_token": "<s>", "eos_token": {"content": E}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(TokenizerError, match="not a DeepSeek-V4 tokenizer"):
        ChatTokenizer.from_dir(tmp_path)
