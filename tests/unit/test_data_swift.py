"""ms-swift data as it is (query/response, sharegpt, --columns, gold wrappers), chat-template
kwargs (enable_thinking) and the over-long prompt policy (issues 12.3, 12.4, 14.5)."""

from __future__ import annotations

import json

import pytest

from megagrpo.config import load_config
from megagrpo.data import (
    apply_prompt_policy,
    load_problems,
    parse_gold,
    prompt_ids,
    render_prompt_text,
    resolve_max_prompt_tokens,
)
from megagrpo.data.config import DataConfig, PromptConfig
from megagrpo.errors import ConfigError, DataError
from megagrpo.rewards import build_composite
from megagrpo.rewards.config import RewardsConfig

# Qwen3's generation-prompt switch (the end of its chat template): enable_thinking=false
# pre-fills an empty think block so the hybrid model answers without reasoning.
QWEN3_GEN_SWITCH = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
CHATML_TURNS = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "solution,gold",
    [
        ("b", ["b"]),
        ("a,d", ["a", "d"]),
        ("Ａ、Ｄ", ["a", "d"]),
        ("<answer> b </answer>", ["b"]),  # was ["<answer>", "b", "</answer>"]: scored 0
        ("<answer>a, d</answer>", ["a", "d"]),
        ("答え: b", ["b"]),  # was ["答え:", "b"]
        ("答え：ｂ，ｄ", ["b", "d"]),
        ("\\boxed{C}", ["c"]),
        ("The answer is (c).", ["c"]),
        ("cd", ["c", "d"]),
        ("36", ["36"]),
        ("答え: 7.20", ["7.20"]),
        (["b", "<answer>d</answer>"], ["b", "d"]),
        ("#### 72", None),
        ("The mitochondria", None),
        ("aa", None),
    ],
)
def test_parse_gold(solution, gold):
    assert parse_gold(solution) == gold


def test_swift_row_formats_and_columns(tmp_path):
    rows = [
        {"query": "Q1 どれか。", "response": "<answer> b </answer>", "system": "S"},
        {
            "query": "Q2",
            "history": [["earlier q", "earlier a"]],
            "response": "答え: a,d",
            "id": "q2",
        },
        {
            "conversations": [
                {"from": "system", "value": "S3"},
                {"from": "human", "value": "Q3"},
                {"from": "gpt", "value": "c"},
            ]
        },
        {"messages": [{"role": "user", "content": "Q4"}], "answer": "e", "task": "mcq"},
        {"question": "Q5", "label": "b"},
    ]
    path = write_jsonl(tmp_path / "swift.jsonl", rows[:4])
    probs = load_problems([path])
    assert [p.answer for p in probs] == [["b"], ["a", "d"], ["c"], ["e"]]
    assert probs[0].messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1 どれか。"},
    ]
    assert probs[1].id == "q2" and [m["role"] for m in probs[1].messages] == [
        "user",
        "assistant",
        "user",
    ]
    assert probs[2].messages[-1] == {"role": "user", "content": "Q3"}
    assert probs[3].meta["task"] == "mcq" and probs[3].meta["solution"] == "e"
    reward = build_composite(RewardsConfig())
    assert reward(["答え: b"], probs[0])[0] == [1.0]  # scored 0.0 before (junk gold)
    remapped = write_jsonl(tmp_path / "cols.jsonl", rows[4:])
    with pytest.raises(DataError, match=r"cols.jsonl:1: unknown record format.*data.columns"):
        load_problems([remapped])
    (p,) = load_problems([remapped], columns={"question": "query", "label": "solution"})
    assert p.messages == [{"role": "user", "content": "Q5"}] and p.answer == ["b"]
    sys_prompt = load_problems([path], prompt=PromptConfig(system="SYS"))
    assert sys_prompt[0].messages[0]["content"] == "S"  # the row's own system wins
    assert sys_prompt[3].messages[0] == {"role": "system", "content": "SYS"}


def test_free_text_gold_is_counted_and_bad_rows_named(tmp_path):
    path = write_jsonl(
        tmp_path / "gsm.jsonl",
        [
            {"messages": [{"role": "user", "content": "1+1?"}], "solution": "#### 2"},
            {"messages": [{"role": "user", "content": "x"}], "solution": "a"},
        ],
    )
    probs = load_problems([path])
    assert probs.free_text_gold == ["gsm:1"] and probs[0].answer == []
    assert probs[0].meta["solution"] == "#### 2"  # kept for plugin rewards
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"conversations": [{"from": "robot", "value": "x"}]}]
    )
    with pytest.raises(DataError, match="bad.jsonl:1: unknown sharegpt speaker 'robot'"):
        load_problems([bad])
    with pytest.raises(ConfigError, match="data.columns"):
        DataConfig(columns=["a=solution", "b=solution"]).validate("data")
    with pytest.raises(ConfigError, match=r"data.columns.0"):
        DataConfig(columns=["answer"]).validate("data")
    cfg = load_config(DataConfig, [], ["columns=[answer=solution]", "columns=[q=query]"])
    assert cfg.column_map() == {"q": "query"}  # a later override replaces the list


def _thinking_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.chat_template = CHATML_TURNS + QWEN3_GEN_SWITCH
    return tok


def test_enable_thinking_reaches_the_chat_template(tmp_path, tiny_tokenizer_dir):
    """Qwen3's hybrid thinking could not be switched off (no chat-template kwargs)."""
    tok = _thinking_tokenizer(tiny_tokenizer_dir)
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "Q"}], "solution": "a"}]
    )
    (default,) = load_problems([path])
    (off,) = load_problems([path], prompt=PromptConfig(enable_thinking=False))
    assert off.meta["chat_template_kwargs"] == {"enable_thinking": False}
    assert render_prompt_text(tok, default).endswith("<|im_start|>assistant\n")
    text = render_prompt_text(tok, off)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text == tok.apply_chat_template(
        off.messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt_ids(tok, off) == tok(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ConfigError, match="contradicts"):
        PromptConfig(
            enable_thinking=True, chat_template_kwargs=["enable_thinking=false"]
        ).validate()
    cfg = load_config(PromptConfig, [], ["chat_template_kwargs=[enable_thinking=false,x=1]"])
    assert cfg.template_kwargs() == {"enable_thinking": False, "x": 1}


def test_prompt_policy_on_igakuqa(igakuqa_dir, tiny_tokenizer_dir):
    """Over-long prompts are handled when the data loads, never mid-run (issue 14.5)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    probs = load_problems([igakuqa_dir / "2018" / "112-A.jsonl"])
    ids = [prompt_ids(tok, p) for p in probs]
    lengths = sorted(len(x) for x in ids)
    limit = lengths[len(lengths) // 2]
    long = {p.id for p, x in zip(probs, ids) if len(x) > limit}
    assert 0 < len(long) < len(probs)

    kept = apply_prompt_policy(probs, ids, limit, "delete")
    assert set(kept.dropped) == long and len(kept.problems) == len(probs) - len(long)
    assert kept.metrics() == {
        "data/prompts_dropped": float(len(long)),
        "data/prompts_truncated": 0.0,
    }

    left = apply_prompt_policy(probs, ids, limit, "left")
    assert set(left.truncated) == long and len(left.problems) == len(probs)
    for p, full in zip(left.problems, ids):
        got = prompt_ids(tok, p)
        assert got == (full[-limit:] if p.id in long else full)  # the engines' prompt ids
        assert len(got) <= limit
    assert "prompt_ids" not in probs[0].meta or probs[0].id not in long  # inputs untouched

    with pytest.raises(DataError, match=rf"{len(long)} prompts are longer than .*={limit}"):
        apply_prompt_policy(probs, ids, limit, "error")
    assert resolve_max_prompt_tokens(DataConfig(), 4096, 512) == 3584
    assert resolve_max_prompt_tokens(DataConfig(max_prompt_tokens=100), 4096, 512) == 100
    with pytest.raises(ConfigError, match="data.max_prompt_tokens"):
        resolve_max_prompt_tokens(DataConfig(max_prompt_tokens=4096), 4096, 512)
    with pytest.raises(ConfigError, match="data.truncation"):
        DataConfig(truncation="right").validate("data")
