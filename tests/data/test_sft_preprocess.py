"""preprocess_data.py --sft: chat templates rendered as transformers renders them, the loss mask on the trained
roles' spans, the SFT dataset (``P`` + ``P_loss_mask``) and bad lines.

Two templates written here on the local Llama 3 / Qwen2.5 stand-in tokenizers (``family_tokenizer``): a Llama-3-style
one (as Meta's: ``| trim`` of the content, BOS on the first message, ``raise_exception`` on an unknown role) and a
ChatML one whose assistant turns are ``{% generation %}`` blocks, so transformers' own ``assistant_masks`` is an
oracle for our mask.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.sft_examples import (
    BadExample,
    SftExampleEncoder,
    SftOptions,
    load_template,
    target_mask,
)
from megatron.testing.tokenizers import family_tokenizer
from megatron.tokenizer import HFTokenizer, TokenizerFileError
from megatron.tokenizer.chat_template import (
    ChatTemplate,
    TemplateSource,
    find_chat_template,
    template_tokens,
)
from tools import preprocess_data

pytestmark = pytest.mark.timeout(180)

LLAMA3 = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = """{% for message in messages %}
{% if message['role'] == 'assistant' %}
{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}
{% else %}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""
TEMPLATES = {"llama3": (LLAMA3, "<|eot_id|>"), "qwen2": (CHATML, "<|im_end|>")}


def _chat(*turns: str) -> list[dict[str, str]]:
    """Messages from ``role: content`` strings."""
    return [dict(zip(("role", "content"), t.split(": ", 1))) for t in turns]


CONVERSATIONS = [
    _chat("system: You are terse.", "user: Hi there!", "assistant: Hello. How can I help?"),
    _chat("user: 2+2?", "assistant: 4", "user: and 3*3?", "assistant: It is 9, of course."),
    _chat("user: ", "assistant: "),  # empty contents
    _chat("user: Grüße aus 東京 🙂 Cafe\u0301", "assistant: Ça va 🚀 ﬁne, ß."),
    _chat("user: x", "assistant: \n\nstarts with newlines and ends with spaces  "),
    _chat("user: <|im_end|> as text", "assistant: ok", "user: a last question without answer"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both stand-in tokenizers with their template in tokenizer_config.json (a small BPE: ~1 s each), and a
    copy of the Llama 3 one without a template."""
    root = tmp_path_factory.mktemp("sft-tokenizers")
    out = {}
    for kind, (template, _) in TEMPLATES.items():
        folder = family_tokenizer(kind, root / kind, merges=300)  # type: ignore[arg-type]
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if kind == "llama3":
            shutil.copytree(folder, root / "plain")
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        out[kind] = folder
    out["plain"] = root / "plain"
    return out


_TOKENIZERS: dict[str, HFTokenizer] = {}


def _tokenizer(folder: Path) -> HFTokenizer:
    """One tokenizer per folder (the reference encoder: the chat path uses it, and it loads faster)."""
    if str(folder) not in _TOKENIZERS:
        _TOKENIZERS[str(folder)] = HFTokenizer(str(folder), fast=False)
    return _TOKENIZERS[str(folder)]


def _encoder(folder: Path, options: SftOptions | None = None) -> SftExampleEncoder:
    options = options or SftOptions()
    tokenizer = _tokenizer(folder)
    template = load_template("HFTokenizer", str(folder), options.chat_template)
    return SftExampleEncoder(tokenizer, template, options)


def _line(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of every run of ones."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_ids_equal_transformers_and_the_mask_is_the_assistant_turns(
    folders: dict[str, Path], kind: str
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folders[kind]), local_files_only=True)
    encoder = _encoder(folders[kind])
    eot = TEMPLATES[kind][1]
    for messages in CONVERSATIONS:
        example = encoder.example(_line({"messages": messages}))
        assert example.ids == list(hf.apply_chat_template(messages, return_dict=False)), messages
        assert len(example.mask) == len(example.ids) and example.mask.dtype == np.uint8
        if kind == "qwen2":  # the {% generation %} blocks: transformers' own assistant mask
            ref = hf.apply_chat_template(messages, return_assistant_tokens_mask=True)
            assert example.mask.tolist() == ref["assistant_masks"]
        # Decoded per span: the content (trimmed by the Llama 3 template) and the end of turn, nothing more.
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        runs = [encoder.tokenizer.detokenize(example.ids[a:b]) for a, b in _runs(example.mask)]
        assert len(runs) == len(answers), runs
        for run, answer in zip(runs, answers):
            # ChatML keeps a content's leading "\n\n", which merges with the header's "\n" into one token: it
            # straddles the span's start and is a target (documented); the Llama 3 template trims the content.
            straddle = "\n" if kind == "qwen2" and answer.startswith("\n") else ""
            assert run == straddle + (answer.strip() if kind == "llama3" else answer) + eot, run
    # a pair is the conversation [user: prompt, assistant: response]
    pair = encoder.example(_line({"prompt": "2+2?", "response": "4"}))
    chat = encoder.example(_line({"messages": _chat("user: 2+2?", "assistant: 4")}))
    assert (pair.ids, pair.mask.tolist(), pair.chat, chat.chat) == (
        chat.ids,
        chat.mask.tolist(),
        False,
        True,
    )


def test_loss_roles_plain_pairs_and_template_sources(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    messages = CONVERSATIONS[0]
    line = _line({"messages": messages})
    every = _encoder(folders["qwen2"], SftOptions(loss_roles=("all",))).example(line)
    assert every.mask.all()
    users = _encoder(folders["qwen2"], SftOptions(loss_roles=("user", "system"))).example(line)
    tok = users.ids
    runs = [_tokenizer(folders["qwen2"]).detokenize(tok[a:b]) for a, b in _runs(users.mask)]
    # other roles: the whole rendered message (its header too), less the trailing newline
    assert runs == [
        "<|im_start|>system\nYou are terse.<|im_end|>",
        "<|im_start|>user\nHi there!<|im_end|>",
    ]
    # no template: BOS (the tokenizer's own prefix) + prompt + response + EOS, the mask on response + EOS
    plain = _encoder(folders["plain"])
    assert plain.template is None
    pair = plain.example(_line({"prompt": "2+2?", "response": " 4"}))
    t = plain.tokenizer
    assert pair.ids == [128_000, *t.tokenize("2+2?"), *t.tokenize(" 4"), 128_001]
    assert pair.mask.tolist() == [0] * (1 + len(t.tokenize("2+2?"))) + [1] * (
        len(t.tokenize(" 4")) + 1
    )
    # chat_template.jinja wins over tokenizer_config.json; --chat-template wins over both
    folder = tmp_path / "tok"
    shutil.copytree(folders["qwen2"], folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    jinja = _encoder(folder).example(_line({"prompt": "a", "response": "b"}))
    assert (
        _tokenizer(folder).detokenize(jinja.ids) == "[user]a<|endoftext|>[assistant]b<|endoftext|>"
    )
    override = tmp_path / "t.jinja"
    override.write_text("{% for m in messages %}{{ m['content'] }};{% endfor %}")
    ids = _encoder(folder, SftOptions(chat_template=str(override))).example(
        _line({"prompt": "a", "response": "b"})
    )
    assert _tokenizer(folder).detokenize(ids.ids) == "a;b;"


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ("{not json", "invalid JSON"),
        ([1, 2], "expected a JSON object, got a list"),
        (
            {"text": "hi"},
            "neither key 'messages' nor keys 'prompt' and 'response' (the line has keys: 'text')",
        ),
        ({"messages": []}, "key 'messages' is an empty list"),
        ({"messages": "hi"}, "key 'messages' is a str"),
        ({"messages": ["hi"]}, "messages[0] is a str; expected an object"),
        ({"messages": [{"content": "hi"}]}, "messages[0] has no 'role'"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0] 'content' is a int"),
        (
            {"messages": _chat("user: hi", "user: again")},
            "no message of the trained roles (assistant)",
        ),
        (
            {"messages": _chat("user: hi", "robot: beep", "assistant: ok")},
            "the chat template raised: unknown role robot",
        ),
        ({"prompt": "hi", "response": 4}, "key 'response' is a int; expected a string"),
    ],
)
def test_bad_lines_name_the_reason(folders: dict[str, Path], obj: Any, reason: str) -> None:
    encoder = _encoder(folders["llama3"])
    with pytest.raises(BadExample, match=None) as caught:
        encoder.example(obj.encode() if isinstance(obj, str) else _line(obj))
    assert reason in str(caught.value)


def test_unstable_template_and_chat_without_template(folders: dict[str, Path]) -> None:
    unstable = ChatTemplate(
        TemplateSource(
            "{% for m in messages %}{{ m['content'] }}{% if loop.last %}<|im_end|>{% endif %}{% endfor %}",
            "unstable.jinja",
        ),
        {},
    )
    encoder = _encoder(folders["qwen2"])
    encoder.template = unstable
    with pytest.raises(
        BadExample,
        match=r"not prefix-stable: its rendering of the first 1 message\(s\) with the generation prompt differs",
    ):
        encoder.example(_line({"messages": _chat("user: a", "assistant: b", "user: c")}))
    encoder.template = ChatTemplate(
        TemplateSource("{{ (messages | length) / 0 }}", "div.jinja"), {}
    )
    with pytest.raises(BadExample, match="the chat template raised ZeroDivisionError"):
        encoder.example(_line({"messages": CONVERSATIONS[0]}))
    with pytest.raises(BadExample, match="a chat needs a chat template.*--chat-template FILE"):
        _encoder(folders["plain"]).example(_line({"messages": CONVERSATIONS[0]}))


def test_straddling_tokens_are_targets() -> None:
    # tokens [0,3) [3,5) [5,9) [9,9) [9,12); spans [4,6) and [9,10)
    mask = target_mask([(0, 3), (3, 5), (5, 9), (9, 9), (9, 12)], [(4, 6), (9, 10)])
    assert mask.tolist() == [0, 1, 1, 1, 1]
    assert target_mask([(0, 2), (2, 4)], []).tolist() == [0, 0]
    assert target_mask([(0, 2), (2, 4)], [(2, 3)]).tolist() == [0, 1]


def test_cli_writes_tokens_and_mask_and_stops_at_a_bad_line(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"messages": m} for m in CONVERSATIONS] + [{"prompt": "2+2?", "response": "4"}]
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:3])
        + "\n"
        + "".join(json.dumps(r) + "\n" for r in rows[3:])
    )
    argv = [
        "--sft",
        "--input",
        str(src),
        "--tokenizer-type",
        "HFTokenizer",
        "--log-interval",
        "1000000",
    ]
    argv += ["--tokenizer-model", str(folders["qwen2"]), "--output-prefix", str(tmp_path / "o")]
    assert preprocess_data.main([*argv, "--workers", "2"]) == 0
    err = capsys.readouterr().err
    encoder = _encoder(folders["qwen2"])
    examples = [encoder.example(_line(r)) for r in rows]
    tokens = MMapIndexedDataset(str(tmp_path / "o_text_document"))
    mask = MMapIndexedDataset(str(tmp_path / "o_text_document_loss_mask"))
    assert (tokens.dtype, mask.dtype, len(tokens), len(mask)) == (np.int32, np.uint8, 7, 7)
    assert tokens.sizes.tolist() == mask.sizes.tolist() == [len(e.ids) for e in examples]
    assert tokens.doc_idx.tolist() == mask.doc_idx.tolist() == list(range(8))
    for i, e in enumerate(examples):
        assert tokens[i].tolist() == e.ids and mask[i].tolist() == e.mask.tolist()
    total, targets = sum(len(e.ids) for e in examples), sum(int(e.mask.sum()) for e in examples)
    assert (
        f"done: 6 conversations, 1 prompt/response pairs, {total:,} tokens, {targets:,} targets"
        in err
    )
    assert f"wrote {tmp_path / 'o_text_document_loss_mask'}.bin / .idx" in err
    # a bad line: file:line, exit 1, nothing written; --skip-bad-lines counts it
    src.write_text(
        src.read_text() + json.dumps({"messages": _chat("user: hi", "user: again")}) + "\n"
    )
    shutil.rmtree(tmp_path / "x", ignore_errors=True)
    (tmp_path / "x").mkdir()
    bad = [*argv[:-1], str(tmp_path / "x" / "o")]
    assert preprocess_data.main(bad) == 1
    err = capsys.readouterr().err
    assert (
        f"error: {src}:9: no message of the trained roles (assistant)" in err
        and "Traceback" not in err
    )
    assert list((tmp_path / "x").iterdir()) == []
    assert preprocess_data.main([*bad, "--skip-bad-lines"]) == 0
    assert "skipped 1 bad line(s)" in capsys.readouterr().err
    # flags: a template that does not compile is a tokenizer-file error (exit 2)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    assert preprocess_data.main([*bad, "--chat-template", str(broken)]) == 2
    assert "broken.jinja: the chat template does not compile (line 1" in capsys.readouterr().err


def test_template_sources_in_a_folder(tmp_path: Path) -> None:
    config = tmp_path / "tokenizer_config.json"
    assert find_chat_template(str(tmp_path)) is None  # no files at all
    config.write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D"},
                ]
            }
        )
    )
    assert find_chat_template(str(tmp_path)).text == "D"  # type: ignore[union-attr]
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(TokenizerFileError, match="named templates tool_use but no 'default'"):
        find_chat_template(str(tmp_path))
    config.write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(TokenizerFileError, match="chat_template is a int"):
        find_chat_template(str(tmp_path))
    (tmp_path / "chat_templates").mkdir()
    (tmp_path / "chat_templates" / "default.jinja").write_text("F")
    assert find_chat_template(str(tmp_path)).text == "F"  # type: ignore[union-attr]
    with pytest.raises(TokenizerFileError, match="--chat-template .*nope.jinja does not exist"):
        find_chat_template(str(tmp_path), str(tmp_path / "nope.jinja"))
    config.write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": None})
    )
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"unk_token": "<unk>", "eos_token": "<x>"})
    )
    assert template_tokens(str(tmp_path)) == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }


def _generated_conversations(n: int) -> list[list[dict[str, str]]]:
    """``n`` conversations of 1-4 turns cut from the pydoc topics (some with a system message, one in seven with
    an empty answer, some ending on a user turn)."""
    from megatron.data.demo_corpus import pydoc_topics

    texts = [t[: 40 + (i * 37) % 400] for i, t in enumerate(pydoc_topics())]
    out = []
    for i in range(n):
        pick = [texts[(i * 7 + k) % len(texts)] for k in range(9)]
        messages = [{"role": "system", "content": pick[0]}] if i % 3 == 0 else []
        for turn in range(1 + i % 4):
            messages.append({"role": "user", "content": pick[1 + 2 * turn]})
            answer = "" if (i + turn) % 7 == 0 else pick[2 + 2 * turn]
            messages.append({"role": "assistant", "content": answer})
        if i % 5 == 0:
            messages.append({"role": "user", "content": pick[8]})
        out.append(messages)
    return out


QWEN25_LIKE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {%- set ns.turns = ns.turns + 1 %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\n' + message.content | trim + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
"""Qwen2.5's template without its tool branches (whitespace control, ``namespace``, attribute access, a default
system message, ``| trim``): the dialect of the templates models ship."""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen2.5-like"])
def test_many_conversations_equal_transformers(
    folders: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    folder = folders[kind.split(".")[0]]
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    template = None
    if kind == "qwen2.5-like":
        template = QWEN25_LIKE
        (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
    encoder = _encoder(folder, SftOptions(chat_template=template and str(tmp_path / "t.jinja")))
    for messages in _generated_conversations(150):
        example = encoder.example(_line({"messages": messages}))
        ref = hf.apply_chat_template(messages, chat_template=template, return_dict=False)
        assert example.ids == list(ref)
        if kind == "qwen2.5-like":
            runs = [encoder.tokenizer.detokenize(example.ids[a:b]) for a, b in _runs(example.mask)]
            answers = [
                m["content"].strip() + "<|im_end|>" for m in messages if m["role"] == "assistant"
            ]
            assert runs == answers
        elif kind == "qwen2":
            ref = hf.apply_chat_template(messages, return_assistant_tokens_mask=True)
            assert example.mask.tolist() == ref["assistant_masks"]
        else:
            runs = [encoder.tokenizer.detokenize(example.ids[a:b]) for a, b in _runs(example.mask)]
            answers = [
                m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant"
            ]
            assert runs == answers


@pytest.mark.slow
def test_same_bytes_for_any_worker_count_gz_and_tokenizer_json(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gzip

    rows = [{"messages": m} for m in _generated_conversations(300)]
    rows += [{"q": f"prompt {i}", "a": f"answer {i}"} for i in range(50)]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "in.jsonl").write_bytes(data)
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(data, mtime=0))
    base = ["--sft", "--tokenizer-type", "HFTokenizer", "--prompt-key", "q", "--response-key", "a"]
    base += ["--log-interval", "40"]
    outputs = {}
    for name, source, workers, model in (
        ("w1", "in.jsonl", 1, folders["llama3"]),
        ("w3", "in.jsonl", 3, folders["llama3"]),
        ("gz", "in.jsonl.gz", 2, folders["llama3"] / "tokenizer.json"),
    ):
        argv = [*base, "--input", str(tmp_path / source), "--workers", str(workers)]
        argv += ["--tokenizer-model", str(model), "--output-prefix", str(tmp_path / name)]
        assert preprocess_data.main(argv) == 0
        assert "done: 300 conversations, 50 prompt/response pairs" in capsys.readouterr().err
        outputs[name] = [
            (tmp_path / f"{name}_text_document{suffix}{ext}").read_bytes()
            for suffix in ("", "_loss_mask")
            for ext in (".bin", ".idx")
        ]
    assert outputs["w1"] == outputs["w3"] == outputs["gz"]
    every = [*base, "--input", str(tmp_path / "in.jsonl"), "--sft-loss-roles", "all"]
    every += ["--tokenizer-model", str(folders["qwen2"]), "--output-prefix", str(tmp_path / "all")]
    assert preprocess_data.main(every) == 0
    mask = MMapIndexedDataset(str(tmp_path / "all_text_document_loss_mask"))
    assert len(mask) == len(rows) and all(mask[i].all() for i in range(len(mask)))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sft", "--append-eod"], "--append-eod does not apply to --sft"),
        (["--sft", "--json-keys", "text"], "--json-keys does not apply to --sft"),
        (["--sft", "--sft-loss-roles", "all", "user"], "'all' alone for every token"),
        (
            ["--sft", "--prompt-key", "q", "--response-key", "q"],
            "both 'q'; give two different keys",
        ),
        (["--chat-template", "t.jinja"], "--chat-template is an option of --sft; add --sft"),
        (["--sft-loss-roles", "user"], "--sft-loss-roles is an option of --sft"),
    ],
)
def test_flags_that_do_not_go_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o")]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", *flags]
    assert preprocess_data.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1
