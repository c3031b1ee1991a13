"""The bundled prompt set and the prompt/reference file validation."""

from __future__ import annotations

import json

import pytest

from eval.prompt_set import GateInputError, default_prompts_path, load_prompts, load_references


def test_bundled_prompts_are_valid_and_balanced():
    prompts = load_prompts(default_prompts_path())
    assert len(prompts) == 100
    assert len({p.id for p in prompts}) == 100
    assert {p.category for p in prompts} == {"short", "medium", "long"}
    assert {p.kind for p in prompts} == {"instruction", "question", "continuation"}
    for cat in ("short", "medium", "long"):
        assert sum(p.category == cat for p in prompts) >= 20
    words = {p.category: [] for p in prompts}
    for p in prompts:
        words[p.category].append(len(p.prompt.split()))
    assert max(words["short"]) < min(words["long"])
    assert all(p.reference is None for p in prompts)


def test_ids_default_to_line_numbers_and_blank_lines_skip(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b", "chat": true, "id": 7}\n')
    ps = load_prompts(f)
    assert [p.id for p in ps] == ["line-1", "7"] and ps[1].chat is True


def test_references_file_orders_by_prompt_and_checks_ids(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    r = tmp_path / "r.jsonl"
    r.write_text(json.dumps({"id": "b", "reference": "B"}) + "\n" + json.dumps({"id": "a", "reference": "A"}) + "\n")
    assert load_references(r, load_prompts(p)) == ["A", "B"]
    r.write_text(json.dumps({"id": "a", "reference": "A"}) + "\n" + json.dumps({"id": "b", "reference": "B"}) + "\n"
                 + json.dumps({"id": "c", "reference": "C"}) + "\n")
    with pytest.raises(GateInputError, match="matches no prompt"):
        load_references(r, load_prompts(p))


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": 3}', "non-empty string"),
    ('{"prompt": "a", "chat": "yes"}', "true or false"),
    ('{"prompt": "a", "reference": 1}', "must be a string"),
    ('{"prompt": "a", "id": [1]}', "string or an integer"),
])
def test_field_types_are_checked(tmp_path, line, needle):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(GateInputError, match=needle) as info:
        load_prompts(f)
    assert "p.jsonl line 2" in str(info.value)


def test_unicode_line_separators_inside_a_json_string_do_not_split_the_line(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028 / U+2029 / U+0085 raw; JSON Lines ends a record at \\n only."""
    rows = [{"id": "a", "prompt": "first\u2028still first", "reference": "r\u0085r"},
            {"id": "b", "prompt": "second\u2029x", "reference": "ok"}]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    ps = load_prompts(f)
    assert [(p.id, p.prompt, p.reference) for p in ps] == [(r["id"], r["prompt"], r["reference"]) for r in rows]
    refs = tmp_path / "r.jsonl"
    refs.write_text(json.dumps({"id": "b", "reference": "x\u2028y"}, ensure_ascii=False) + "\n"
                    + json.dumps({"id": "a", "reference": "z"}) + "\n", encoding="utf-8")
    assert load_references(refs, ps) == ["z", "x\u2028y"]
