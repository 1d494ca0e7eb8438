"""Fuzz tests (hypothesis) over the readers and the config loader (issue 8).

Properties: any byte string written as a JSONL file, and any JSON value written as a row, gives accepted rows
or counted rejections (``n_read == accepted + rejected``), never another exception; any mapping or YAML text
gives a :class:`JobConfig` or a :class:`ConfigError`, never another exception.
"""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_cluster_ft.config import ConfigError, DataConfig, JobConfig, load_config, parse_config
from ray_cluster_ft.data import canonicalize, example_id, load_examples

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])

# Text that includes lone surrogates, control characters and the chat template's special tokens.
TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=()), max_size=20),
    st.sampled_from(["", " ", "\n", "<|im_end|>", "<|im_start|>assistant\n", "\x00", "\ud800", "héllo", "user"]),
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), TEXT)
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(TEXT, kids, max_size=3),
                    max_leaves=10)
ROW_KEYS = st.sampled_from(["prompt", "response", "question", "answer", "messages", "domain", "source", "text"])
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["system", "user", "assistant", "robot", ""]), JSON),
    "content": st.one_of(TEXT, JSON),
})
ROW = st.one_of(
    JSON,
    st.fixed_dictionaries({"prompt": TEXT, "response": TEXT}, optional={"domain": JSON, "source": JSON}),
    st.fixed_dictionaries({"question": st.one_of(TEXT, JSON), "answer": st.one_of(TEXT, JSON)}),
    st.dictionaries(ROW_KEYS, st.one_of(TEXT, JSON), max_size=4),
    st.fixed_dictionaries({"messages": st.one_of(st.lists(st.one_of(MESSAGE, JSON), max_size=4), JSON)}),
)


@pytest.fixture(scope="module")
def tok(demo_tokenizer):
    """The real demo tokenizer (``load_tokenizer('demo')``), loaded once per session by conftest."""
    return demo_tokenizer


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _expected_rows(data: bytes) -> int:
    """Non-blank lines, as a binary file iterator splits them (on b'\\n'); a BOM on line 1 is not content."""
    lines = data.split(b"\n")
    if lines and lines[0].startswith(b"\xef\xbb\xbf"):
        lines[0] = lines[0][3:]
    return sum(1 for line in lines if line.strip())


def _load(path, tok):
    return load_examples(DataConfig(source="files", paths=[str(path)], max_seq_len=64, eval_fraction=0.0), tok)


@FUZZ
@given(data=st.one_of(
    st.binary(max_size=300),
    st.lists(st.one_of(st.binary(max_size=40), JSON.map(lambda v: json.dumps(v).encode())), max_size=6)
    .map(b"\n".join),
))
def test_any_bytes_as_jsonl(tok, fuzz_dir, data):
    f = fuzz_dir / "bytes.jsonl"
    f.write_bytes(data)
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):  # a UTF-16/32 byte-order mark: the file is refused whole
        with pytest.raises(ConfigError, match="UTF-16 or UTF-32 encoded"):
            _load(f, tok)
        return
    res = _load(f, tok)
    assert res.n_read == _expected_rows(data)
    assert res.n_read == res.train.num_rows + res.eval.num_rows + len(res.rejected)
    for r in res.rejected:
        assert r.reason and r.source == str(f) and 1 <= r.position <= data.count(b"\n") + 1
        json.loads(r.to_json().encode("utf-8"))


@FUZZ
@given(row=ROW)
def test_any_json_value_as_row(tok, fuzz_dir, row):
    f = fuzz_dir / "row.jsonl"
    f.write_text(json.dumps(row) + "\n", encoding="ascii")  # ensure_ascii: surrogates travel as \ud800 escapes
    res = _load(f, tok)
    accepted = res.train.num_rows + res.eval.num_rows
    assert res.n_read == 1 and accepted + len(res.rejected) == 1
    try:
        msgs = canonicalize(row)
    except ValueError:
        assert len(res.rejected) == 1  # a row canonicalize refuses is never accepted
        return
    domain = row.get("domain")
    if isinstance(domain, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in domain):
        assert [r.reason.split(":")[0] for r in res.rejected] == ["invalid Unicode in field 'domain'"]
        return
    if (domain is not None and not isinstance(domain, str)) or (isinstance(domain, str) and
                                                                 " ".join(domain.split()) == "all"):
        assert [r.reason.split(":")[0].split(" is ")[0] for r in res.rejected] == [
            "reserved domain" if isinstance(domain, str) else "field 'domain'"]
        return
    source = row.get("source")
    if isinstance(source, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in source):
        assert [r.reason.split(":")[0] for r in res.rejected] == ["invalid Unicode in field 'source'"]
        return
    if accepted:
        assert res.train.column("example_id").to_pylist() == [example_id(msgs)]
    else:  # accepted by canonicalize, refused by tokenization (over 64 tokens, nothing left to learn, or a
        # prompt of special tokens only, which the tokenizer reads as markup, not text)
        assert res.rejected[0].reason.startswith(("over max length", "empty response", "empty prompt"))


SECTION_KEYS = {name: list(f.annotation.model_fields) for name, f in JobConfig.model_fields.items()
                if isinstance(f.annotation, type)}  # the sections (``preset`` is a plain value)
CONFIG_KEY = st.one_of(st.sampled_from(sorted({k for ks in SECTION_KEYS.values() for k in ks})), TEXT)
CONFIG = st.dictionaries(
    st.one_of(st.sampled_from(list(SECTION_KEYS)), TEXT),
    st.one_of(st.dictionaries(CONFIG_KEY, JSON, max_size=4), JSON),
    max_size=4,
)


@FUZZ
@given(raw=st.one_of(CONFIG, JSON))
def test_any_mapping_as_config(raw):
    try:
        cfg = parse_config(raw)
    except ConfigError as err:
        assert str(err).startswith("invalid job config")
        return
    assert isinstance(cfg, JobConfig)


@FUZZ
@given(text=st.one_of(
    st.text(max_size=200),
    CONFIG.map(lambda c: yaml.safe_dump(c, allow_unicode=False)),
    st.binary(max_size=100).map(lambda b: b.decode("latin-1")),
))
def test_any_yaml_as_config(fuzz_dir, text):
    f = fuzz_dir / "job.yaml"
    f.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    try:
        cfg = load_config(f, {"output.dir": "runs/x"})
    except ConfigError as err:
        assert str(err)
        return
    assert isinstance(cfg, JobConfig) and cfg.output.dir == "runs/x"


@pytest.mark.parametrize("field", ["domain", "source"])
def test_a_lone_surrogate_in_the_domain_or_source_is_a_counted_rejection(tok, fuzz_dir, field):
    # Both found by the fuzz test above: the text fields refused it, the field reached Arrow and failed the whole
    # load (the source in row {'prompt': '0', 'response': '0', 'source': '\ud800'}).
    f = fuzz_dir / f"{field}.jsonl"
    rows = [{"prompt": "0", "response": "0", field: "\ud800"}, {"prompt": "Say hi.", "response": "Hi there."}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="ascii")
    res = _load(f, tok)
    assert res.n_read == 2 and res.train.num_rows + res.eval.num_rows == 1
    assert [(r.position, r.reason) for r in res.rejected] == [  # positions are line numbers
        (1, f"invalid Unicode in field '{field}': lone surrogate '\\ud800' at character 0")]
