"""The row formats users bring (docs/data.md), checked end to end through the demo model's chat template: the
decoded training text of each row holds every text field its format defines, and exactly the assistant/response
tokens carry labels. The expected strings are written out by hand from SmolLM2's ChatML template."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_cluster_ft.config import ConfigError, DataConfig
from ray_cluster_ft.data import load_examples
from ray_cluster_ft.data.formats import FORMATS, apply_columns, canonical_row
from ray_cluster_ft.data.tokenize import tokenize_rows

SYS = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def _u(text):
    return f"<|im_start|>user\n{text}<|im_end|>\n"


def _a(text):
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


# (format, row, the whole decoded chat, the decoded trained tokens)
CASES = [
    ("messages",
     {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4"}]},
     "<|im_start|>system\nBe brief.<|im_end|>\n" + _u("Hi") + _a("Hello.") + _u("2+2?") + _a("4"),
     "Hello.<|im_end|>\n4<|im_end|>\n"),
    ("sharegpt",
     {"conversations": [{"from": "system", "value": "Answer in one word."}, {"from": "human", "value": "Sky colour?"},
                        {"from": "gpt", "value": "Blue."}, {"from": "human", "value": "Grass?"},
                        {"from": "gpt", "value": "Green."}]},
     "<|im_start|>system\nAnswer in one word.<|im_end|>\n" + _u("Sky colour?") + _a("Blue.") + _u("Grass?")
     + _a("Green."),
     "Blue.<|im_end|>\nGreen.<|im_end|>\n"),
    ("alpaca",
     {"instruction": "Summarize the following paragraph.", "input": "Cats sleep up to sixteen hours a day.",
      "output": "Cats sleep a lot.", "system": "You summarize."},
     "<|im_start|>system\nYou summarize.<|im_end|>\n"
     + _u("Summarize the following paragraph.\n\nCats sleep up to sixteen hours a day.") + _a("Cats sleep a lot."),
     "Cats sleep a lot.<|im_end|>\n"),
    ("alpaca",
     {"instruction": "And dogs?", "input": "", "output": "Dogs sleep less.",
      "history": [["How long do cats sleep?", "About 15 hours."]]},
     SYS + _u("How long do cats sleep?") + _a("About 15 hours.") + _u("And dogs?") + _a("Dogs sleep less."),
     "About 15 hours.<|im_end|>\nDogs sleep less.<|im_end|>\n"),
    ("prompt_completion",
     {"prompt": "The capital of France is", "completion": " Paris."},
     SYS + _u("The capital of France is") + _a(" Paris."),
     " Paris.<|im_end|>\n"),
    ("prompt_completion",  # TRL conversational: only the completion is trained, not the prompt's assistant turn
     {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                 {"role": "user", "content": "Capital of Italy?"}],
      "completion": [{"role": "assistant", "content": "Rome."}]},
     SYS + _u("Hi") + _a("Hello!") + _u("Capital of Italy?") + _a("Rome."),
     "Rome.<|im_end|>\n"),
    ("prompt_response",
     {"prompt": "Write a haiku.", "response": "Old pond, frog jumps in.", "domain": "poetry"},
     SYS + _u("Write a haiku.") + _a("Old pond, frog jumps in."),
     "Old pond, frog jumps in.<|im_end|>\n"),
    ("question_answer",
     {"question": "Does aspirin reduce fever?", "context": "A trial of 200 adults found aspirin lowered fever.",
      "answer": "Yes, in the trial it did."},
     SYS + _u("Does aspirin reduce fever?\n\nA trial of 200 adults found aspirin lowered fever.")
     + _a("Yes, in the trial it did."),
     "Yes, in the trial it did.<|im_end|>\n"),
    ("messages",  # opens with the assistant's greeting: context, untrained (it answers no prompt)
     {"messages": [{"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4"}]},
     SYS + _a("Hi, how can I help?") + _u("2+2?") + _a("4"),
     "4<|im_end|>\n"),
    ("sharegpt",
     {"conversations": [{"from": "gpt", "value": "Hello! Ask me anything."}, {"from": "human", "value": "Grass?"},
                        {"from": "gpt", "value": "Green."}]},
     SYS + _a("Hello! Ask me anything.") + _u("Grass?") + _a("Green."),
     "Green.<|im_end|>\n"),
    ("messages",  # OpenAI content parts: the text parts joined in order
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "Sky "}, {"type": "text", "text": "colour?"}]},
                   {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}]},
     SYS + _u("Sky colour?") + _a("Blue."),
     "Blue.<|im_end|>\n"),
]


def _decode(tok, row, **kw):
    fmt, msgs, unused = canonical_row(row, kw.pop("fmt", "auto"), kw.pop("columns", None))
    ids, labels, _cut = tokenize_rows([msgs], tok, 512, **kw)[0]
    trained = tok.decode([i for i, lab in zip(ids, labels) if lab != -100])
    assert all(lab in (-100, i) for i, lab in zip(ids, labels))
    return fmt, unused, tok.decode(ids), trained


@pytest.mark.parametrize("fmt, row, full, trained", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_format_trains_exactly_the_replies(demo_tokenizer, fmt, row, full, trained):
    got = _decode(demo_tokenizer, row)
    assert got == (fmt, [], full, trained)
    assert _decode(demo_tokenizer, row, fmt=fmt)[2:] == (full, trained)  # forcing the format: the same


def test_last_assistant_turn_masks_earlier_replies(demo_tokenizer):
    row = CASES[0][1]
    assert _decode(demo_tokenizer, row, train_on="last_assistant_turn")[3] == "4<|im_end|>\n"


def test_default_system_prompt_replaced_or_removed(demo_tokenizer):
    row = {"prompt": "Hi", "response": "Hello."}
    assert _decode(demo_tokenizer, row, system_prompt="You are a nurse.")[2] == (
        "<|im_start|>system\nYou are a nurse.<|im_end|>\n" + _u("Hi") + _a("Hello."))
    assert _decode(demo_tokenizer, row, system_prompt="")[2:] == (_u("Hi") + _a("Hello."), "Hello.<|im_end|>\n")
    own = {"messages": [{"role": "system", "content": "Mine."}, *[{"role": r, "content": c} for r, c in
                                                                  (("user", "Hi"), ("assistant", "Hello."))]]}
    assert _decode(demo_tokenizer, own, system_prompt="")[2].startswith("<|im_start|>system\nMine.")


def test_columns_map_and_join_fields(demo_tokenizer):
    row = {"question": "Is it safe?", "context": "Study: it was safe in 90% of cases.",
           "long_answer": "Mostly, yes.", "final_decision": "yes"}
    cols = {"prompt": ["question", "context"], "response": "long_answer"}
    assert apply_columns(row, cols)[0] == {"final_decision": "yes", "prompt": "Is it safe?\n\nStudy: it was safe in "
                                           "90% of cases.", "response": "Mostly, yes."}
    fmt, unused, full, trained = _decode(demo_tokenizer, row, columns=cols)
    assert (fmt, unused, trained) == ("prompt_response", [], "Mostly, yes.<|im_end|>\n")
    assert full == SYS + _u("Is it safe?\n\nStudy: it was safe in 90% of cases.") + _a("Mostly, yes.")
    with pytest.raises(ValueError, match=r"missing field 'answer' \(the row has long_answer, final_decision; map "
                                          r"them with data.columns\)$"):
        canonical_row(row)
    # A row without any field mapped to a target is told which fields it lacks, not that the target is null.
    with pytest.raises(ValueError, match=r"^missing field 'question' or 'context' \(data.columns maps it to "
                                          r"'prompt'\)$"):
        canonical_row({"instruction": "no output here"}, columns=cols)
    with pytest.raises(ValueError, match=r"^missing field 'long_answer' \(data.columns maps it to 'response'\)$"):
        canonical_row({"question": "Q?"}, columns=cols)
    with pytest.raises(ValueError, match=r"^field 'response' is null$"):  # the row has it, null
        canonical_row({"question": "Q?", "long_answer": None}, columns=cols)


def test_unused_text_fields_are_named_unless_already_trained():
    # The Alpaca row renamed to prompt/response: its input paragraph would be lost.
    row = {"prompt": "Summarize the following paragraph.", "response": "Short.", "input": "A long paragraph here.",
           "id": "x-1", "url": "https://e.org/a b c", "qtype": "information", "label": "yes"}
    assert canonical_row(row)[2] == ["input"]
    # gpteacher's rows: instruction and input are inside question already.
    row = {"question": "Write it.\n\nwidth: 5", "answer": "done", "instruction": "Write it.", "input": "width: 5"}
    assert canonical_row(row)[2] == []
    assert canonical_row({"prompt": "p", "response": "r", "notes": "five or more words here"})[2] == ["notes"]
    assert canonical_row({"prompt": "p", "response": "r", "qtype": "exams and tests"})[2] == []
    from ray_cluster_ft.data.formats import columns_hint

    assert columns_hint("question_answer", "tests", ["assert f(1) == 2"]) == (
        "'tests' is a list, not text: write it into a text field of the rows first")


def test_unused_field_hint_keeps_what_data_columns_already_maps(tmp_path, demo_tokenizer):
    """A hint that named only ``{prompt: [prompt, context]}`` would, if followed, drop ``question`` (the file has no
    ``prompt``): the hint is the whole mapping with the field joined onto its target."""
    from ray_cluster_ft.data.formats import columns_hint

    p = tmp_path / "qa.jsonl"
    p.write_text(json.dumps({"question": "Why is the sky blue?", "context": "Light scatters off the air.",
                             "answer": "Scattering."}) + "\n")
    cols = {"prompt": "question", "response": "answer"}
    res = load_examples(DataConfig(paths=[str(p)], eval_fraction=0.0, columns=cols), demo_tokenizer)
    hint = res.hints[str(p)]["context"]
    assert (res.unused, hint) == ({str(p): {"context": 1}},
                                  "data.columns: {prompt: [question, context], response: answer}")
    following = {"prompt": ["question", "context"], "response": "answer"}  # the hint, as YAML reads it
    fmt, unused, full, _trained = _decode(demo_tokenizer, json.loads(p.read_text()), columns=following)
    assert (fmt, unused, full) == ("prompt_response", [], SYS + _u("Why is the sky blue?\n\nLight scatters off "
                                                                   "the air.") + _a("Scattering."))
    # a target the mapping does not name is added beside it; a listed target gets the field appended
    assert columns_hint("prompt_response", "input", "x", {"response": "out"}) == (
        "data.columns: {response: out, prompt: [prompt, input]}")
    assert columns_hint("alpaca", "notes", "x", {"instruction": ["task", "details"]}) == (
        "data.columns: {instruction: [task, details, notes]}")


def test_a_columns_source_no_row_has_stops_the_data_stage(tmp_path, demo_tokenizer):
    p = tmp_path / "qa.jsonl"
    p.write_text(json.dumps({"question": "Q?", "context": "C.", "long_answer": "A."}) + "\n"
                 + json.dumps({"question": "Q2?", "long_answer": "A2.", "id": "r2"}) + "\n")

    def load(cols, *more):
        return load_examples(DataConfig(paths=[str(p), *map(str, more)], eval_fraction=0.0, columns=cols),
                             demo_tokenizer)

    with pytest.raises(ConfigError) as err:
        load({"prompt": ["question", "contxt"], "response": "long_answer"})
    assert str(err.value) == (f"data file {p}: data.columns maps prompt from 'contxt', but none of the 2 rows read "
                              "has that field (their fields: question, context, long_answer, id); see docs/data.md "
                              "for data.columns")
    with pytest.raises(ConfigError, match=r"maps prompt from 'questoin' and response from 'long_answr', but none "
                                          r"of the 2 rows read has those fields"):
        load({"prompt": "questoin", "response": "long_answr"})
    # a file with none of the sources, read in its own format, is not what the mapping is for
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(CASES[0][1]) + "\n")
    res = load({"prompt": ["question", "context"], "response": "long_answer"}, chats)
    assert res.formats == {str(p): {"prompt_response": 2}, str(chats): {"messages": 1}}


def test_a_row_in_no_known_format_names_its_fields():
    with pytest.raises(ValueError) as err:
        canonical_row({"text": "a b c", "meta": None})
    assert str(err.value) == (
        "missing field: need 'messages', 'conversations' (sharegpt), 'instruction'+'output' (alpaca), "
        "'prompt'+'completion', 'prompt'+'response' or 'question'+'answer'; map other fields with data.columns "
        "(the row's fields: text, meta (null); see docs/data.md)")


@pytest.mark.parametrize("row, reason", [
    ({"conversations": [{"from": "robot", "value": "x"}]}, "conversations[0].from is 'robot'"),
    ({"conversations": [{"from": "human", "value": "x"}]}, "the last message is not the assistant's response"),
    ({"instruction": "x", "output": " "}, "empty output"),
    ({"instruction": "x", "output": "y", "history": [["only one"]]}, "field 'history' must be a list of"),
    ({"prompt": [{"role": "user", "content": "x"}], "completion": "y"}, "field 'completion' must be a non-empty"),
    ({"question": "q", "answer": "a", "context": 3}, "field 'context' is int"),
])
def test_bad_rows_of_the_new_formats_are_rejected_with_reasons(row, reason):
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("(", r"\(")):
        canonical_row(row)


def test_tool_messages_are_rejected_where_the_template_has_no_tools(demo_tokenizer):
    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                            "name": "weather", "arguments": "{}"}}]},
                        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
    _fmt, msgs, _ = canonical_row(row)
    assert tokenize_rows([msgs], demo_tokenizer, 512) == [
        "tool messages: the model's chat template does not render tool calls or tool results"]


def test_config_format_names_match_the_formats():
    from typing import get_args

    from ray_cluster_ft.config import COLUMN_TARGETS
    from ray_cluster_ft.data.formats import _FIELDS

    assert get_args(DataConfig.model_fields["format"].annotation) == ("auto", *FORMATS)
    assert set(COLUMN_TARGETS) == _FIELDS
    with pytest.raises(ValueError, match="unknown target field 'answr'"):
        DataConfig(columns={"answr": "x"})


def test_files_in_every_format_load_with_formats_and_unused_fields_counted(tmp_path, demo_tokenizer):
    paths = []
    for i, (fmt, row, _full, _trained) in enumerate(CASES):
        p = tmp_path / f"{i}-{fmt}.jsonl"
        p.write_text(json.dumps(row) + "\n" + json.dumps({**row, "note": f"an extra note number {i}"}) + "\n")
        paths.append(p)
    pq.write_table(pa.table({"instruction": ["Add.", "Sub."], "input": ["1 2", "3 1"], "output": ["3", "2"]}),
                   tmp_path / "alpaca.parquet")
    paths.append(tmp_path / "alpaca.parquet")
    res = load_examples(DataConfig(paths=[str(p) for p in paths], eval_fraction=0.0), demo_tokenizer)
    # every second row of a JSONL file repeats the first but for its note: a duplicate example, rejected
    assert res.train.num_rows == len(CASES) + 2 and len(res.rejected) == len(CASES)
    assert {src: f for src, f in res.formats.items()} == {
        **{str(p): {fmt: 2} for p, (fmt, *_rest) in zip(paths, CASES)}, str(paths[-1]): {"alpaca": 2}}
    assert res.unused == {str(p): {"note": 1} for p in paths[:-1]}  # the second row of each file
    assert res.hints[str(paths[2])]["note"] == "data.columns: {instruction: [instruction, note]}"
    t = res.train
    assert t.column("source_file").to_pylist()[:2] == [str(paths[0]), str(paths[1])]
    assert t.column("source_line").to_pylist()[:2] == [1, 1]
    assert t.column("source_line").to_pylist()[-2:] == [0, 1]  # Parquet rows: 0-based index


def test_unused_fields_error_stops_the_data_stage(tmp_path, demo_tokenizer, capsys):
    from ray_cluster_ft.data.stage import _report_fields

    p = tmp_path / "renamed-alpaca.jsonl"
    p.write_text(json.dumps({"prompt": "Summarize.", "response": "Short.", "input": "The paragraph to sum."}) + "\n")
    res = load_examples(DataConfig(paths=[str(p)], eval_fraction=0.0), demo_tokenizer)
    with pytest.raises(ConfigError, match=rf"{p}: field 'input' is not used by the row format in 1 row; to train on "
                                          r"it: data.columns: \{prompt: \[prompt, input\]\}"):
        _report_fields(res, "error")
    _report_fields(res, "warn")
    assert capsys.readouterr().out.count("warning: ") == 1
    _report_fields(res, "ignore")
    assert "warning" not in capsys.readouterr().out


TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}"
    "({{ c['function']['arguments'] }})</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_calls_render_through_a_template_with_tools(demo_tokenizer):
    import copy

    tok = copy.deepcopy(demo_tokenizer)
    tok.chat_template = TOOL_TEMPLATE  # a ChatML template that renders tool calls
    row = {"conversations": [{"from": "human", "value": "Weather in Oslo?"},
                             {"from": "function_call", "value": '{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'},
                             {"from": "observation", "value": "rain, 4 C"},
                             {"from": "gpt", "value": "Rainy and 4 C."}]}
    fmt, msgs, _ = canonical_row(row)
    ids, labels, _ = tokenize_rows([msgs], tok, 512)[0]
    assert fmt == "sharegpt"
    assert tok.decode(ids) == ("<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
                               '<tool_call>weather({"city": "Oslo"})</tool_call><|im_end|>\n'
                               "<|im_start|>tool\nrain, 4 C<|im_end|>\n<|im_start|>assistant\nRainy and 4 C.<|im_end|>\n")
    # both assistant turns are trained, the tool call included; the tool's result is context
    assert tok.decode([i for i, lab in zip(ids, labels) if lab != -100]) == (
        '<tool_call>weather({"city": "Oslo"})</tool_call><|im_end|>\nRainy and 4 C.<|im_end|>\n')
