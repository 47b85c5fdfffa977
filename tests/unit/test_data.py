"""Problem loading from the real IgakuQA files and ms-swift JSONL; bad input named precisely."""

from __future__ import annotations

import json

import pytest

from megagrpo.data import load_problems
from megagrpo.data.config import PromptConfig
from megagrpo.errors import ConfigError, DataError


def raw_records(igakuqa_dir):
    recs = []
    for f in sorted(igakuqa_dir.glob("20*/1*-?.jsonl")):
        recs += [json.loads(x) for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    return recs


def test_loads_every_igakuqa_question(igakuqa_dir):
    raw = raw_records(igakuqa_dir)
    probs = load_problems([igakuqa_dir])  # directory: metadata/translate/baselines ignored
    assert len(raw) == 1200 and len(probs) == 1200
    by_id = {p.id: p for p in probs}
    for rec in raw:
        p = by_id[rec["problem_id"]]
        assert p.answer == [a.lower() for a in rec["answer"]]
        assert p.meta["choices"] == rec["choices"]
        assert p.meta["points"] == int(rec["points"])
        assert p.meta["text_only"] == rec["text_only"]
        assert p.meta["year"] in (2018, 2019, 2020)
        assert rec["problem_text"].strip() in p.messages[-1]["content"]
    assert {p.meta["year"] for p in probs} == {2018, 2019, 2020}
    assert by_id["112A12"].meta["num_choose"] == 2 and by_id["112A15"].meta["num_choose"] == 3
    assert by_id["112C66"].meta["numeric"] and by_id["112C66"].answer == ["26"]


def test_metadata_join_and_image_skip_counted(igakuqa_dir):
    files = [igakuqa_dir / "2018" / "112-A.jsonl"]
    all_ = load_problems(files)
    text_only = load_problems(files, exclude_images=True)
    n_img = sum(not p.meta["text_only"] for p in all_)
    assert n_img > 0
    assert len(text_only) == len(all_) - n_img
    assert len(text_only.skipped["image"]) == n_img
    meta = json.loads((igakuqa_dir / "2018" / "112-A_metadata.jsonl").read_text().splitlines()[0])
    assert all_[0].meta["human_accuracy"] == float(meta["human_accuracy"])


def test_prompt_renders_choices_and_custom_template(igakuqa_dir):
    f = igakuqa_dir / "2018" / "112-A.jsonl"
    p = load_problems([f])[0]
    assert p.messages[0]["role"] == "system" and "答え" in p.messages[0]["content"]
    assert "a. Gaucher病" in p.messages[1]["content"]
    custom = PromptConfig(system="", user_template="Q: {question}\n{choices}\nA:")
    q = load_problems([f], prompt=custom)[0]
    assert len(q.messages) == 1 and q.messages[0]["content"].startswith("Q: ")
    with pytest.raises(ConfigError, match="user_template"):
        load_problems([f], prompt=PromptConfig(user_template="{nope}"))


def test_swift_jsonl(tmp_path):
    f = tmp_path / "swift.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "1+1?"}], "solution": "B"},
        {
            "id": "q2",
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "pick two"},
                {"role": "assistant", "content": "old"},
            ],
            "solution": "c, d",
        },
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    probs = load_problems([f])
    assert [p.id for p in probs] == ["swift:1", "q2"]
    assert probs[0].answer == ["b"] and probs[1].answer == ["c", "d"]
    assert [m["role"] for m in probs[1].messages] == ["system", "user"]


@pytest.mark.parametrize(
    "line,match",
    [
        (
            '{"problem_id": "x1", "problem_text": "q", "choices": ["a"]',
            r"bad\.jsonl:2: malformed JSON",
        ),
        (
            '{"problem_id": "x1", "problem_text": "q", "choices": ["a"], "answer": []}',
            r"bad\.jsonl:2: problem x1 has no answer",
        ),
        ('{"foo": 1}', r"bad\.jsonl:2: unknown record format"),
        ("[1, 2]", r"bad\.jsonl:2: expected a JSON object"),
        (
            '{"problem_id": "ok1", "problem_text": "q", "choices": ["a"], "answer": ["a"]}',
            r"duplicate problem id ok1",
        ),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, match):
    f = tmp_path / "bad.jsonl"
    good = '{"problem_id": "ok1", "problem_text": "q", "choices": ["a"], "answer": ["a"]}'
    f.write_text(good + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=match):
        load_problems([f])


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_problems([tmp_path / "absent.jsonl"])
