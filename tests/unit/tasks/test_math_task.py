"""The math task's pieces: dataset reader, split and sample order; the HF tokenizer and chat
template; the task itself (length filtering, truncation, scoring) and its option checks.

A BPE tokenizer and a random Qwen2 checkpoint are built at test time (tests/support/math_data.py).
"""

from __future__ import annotations

import json

import pytest

from nereusd.errors import ConfigError
from nereusd.tasks import get_task
from nereusd.tasks.dataset import SampleOrder, read_records, split
from nereusd.tasks.tokenizer import HFTokenizer, train_bpe_tokenizer
from tests.support.math_data import build_math_dir, rows


@pytest.fixture(scope="module")
def math_dir(tmp_path_factory):
    return build_math_dir(tmp_path_factory.mktemp("math"))


# ---- dataset -------------------------------------------------------------------------------------


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_and_parquet_read_the_same_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    data = rows(6)
    a = read_records(_jsonl(tmp_path / "d.jsonl", data), "question", "answer")
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "d.parquet")
    b = read_records(tmp_path / "d.parquet", "question", "answer")
    assert a == b and len(a) == 6 and a[2].row == 2 and a[2].answer.endswith("#### 16")


def test_dotted_keys_chat_messages_and_numeric_answers(tmp_path):
    verl_style = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
                   "reward_model": {"ground_truth": 2}}]
    recs = read_records(_jsonl(tmp_path / "v.jsonl", verl_style), "prompt", "reward_model.ground_truth")
    assert recs[0].prompt[1] == {"role": "user", "content": "1+1?"} and recs[0].answer == "2"
    floats = [{"question": "q", "answer": x} for x in (1e20, 5e-05, 72.0)]
    assert [r.answer for r in read_records(_jsonl(tmp_path / "f.jsonl", floats), "question", "answer")] == \
        ["100000000000000000000", "0.00005", "72"]   # positional: "1e+20" would read as 1


def test_jsonl_lines_end_at_newlines_only_and_a_byte_order_mark_is_skipped(tmp_path):
    """U+2028 and U+0085 are allowed raw inside JSON strings (str.splitlines would cut there)."""
    import json

    path = tmp_path / "u.jsonl"
    path.write_text("\ufeff" + json.dumps({"question": "a\u2028b\u0085c", "answer": "1"}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    assert read_records(path, "question", "answer")[0].prompt == "a\u2028b\u0085c"


@pytest.mark.parametrize("content, match", [
    ('{"question": "q"}\n', r"row 0: task.options.answer_key: no column 'answer'; the row's columns: question"),
    ('{"q": "x", "answer": "1"}\n', r"row 0: task.options.prompt_key: no column 'question'; the row's columns: q, answer"),
    ('{"question": "q", "answer": "1"}\n{oops\n', r"d.jsonl:2: not a JSON line"),
    ('{"question": 5, "answer": "1"}\n', r"expected text or chat messages, got int"),
    ('{"question": [{"role": "user"}], "answer": "1"}\n', r"must be chat messages"),
    ('{"question": "q", "answer": null}\n', r"expected text or a number, got NoneType"),
    ('\n\n', r"has no records"),
    ('["question", "answer"]\n', r"d.jsonl:1: expected a JSON object per line, got list"),
    ('{"question": "q", "answer": NaN}\n', r"answer: expected a finite number, got nan"),
])
def test_bad_rows_name_the_file_row_and_key(tmp_path, content, match):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        read_records(path, "question", "answer")


def test_missing_file_unknown_suffix_and_bad_parquet_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such dataset file"):
        read_records(tmp_path / "absent.jsonl", "q", "a")
    (tmp_path / "d.csv").write_text("q,a\n")
    with pytest.raises(ConfigError, match="expected a .jsonl"):
        read_records(tmp_path / "d.csv", "q", "a")
    (tmp_path / "d.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="not a readable parquet file"):
        read_records(tmp_path / "d.parquet", "q", "a")


def test_split_is_deterministic_disjoint_and_complete():
    train, held = split(50, 10, seed=3)
    assert (train, held) == split(50, 10, seed=3)
    assert len(held) == 10 and not set(train) & set(held) and sorted(train + held) == list(range(50))
    assert held != split(50, 10, seed=4)[1]
    with pytest.raises(ConfigError, match="eval_size"):
        split(5, 5, seed=0)


def test_sample_order_is_a_permutation_per_epoch_and_a_pure_function_of_position():
    order = SampleOrder(7, seed=1)
    epoch0 = [order.at(i) for i in range(7)]
    epoch1 = [order.at(i) for i in range(7, 14)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(7)) and epoch0 != epoch1
    fresh = SampleOrder(7, seed=1)   # a restarted job at position 9 sees the same records
    assert [fresh.at(i) for i in (9, 3, 13)] == [epoch1[2], epoch0[3], epoch1[6]]
    with pytest.raises(ValueError):
        order.at(-1)


# ---- tokenizer -----------------------------------------------------------------------------------


def test_render_is_the_chat_template_with_the_generation_prompt(math_dir):
    from transformers import AutoTokenizer

    tok = HFTokenizer(math_dir / "model")
    hf = AutoTokenizer.from_pretrained(str(math_dir / "model"))
    messages = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "Ann has 3 pens."}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.render("Ann has 3 pens.", system_prompt="Solve it.")
    assert ids == hf.encode(expected, add_special_tokens=False)
    assert tok._tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.render(messages, system_prompt="ignored: the prompt has one") == ids
    assert tok.render("Ann has 3 pens.", chat_template=False) == tok.encode("Ann has 3 pens.")
    assert tok.decode(tok.encode("42 pens")) == "42 pens"


def test_a_trained_tokenizer_encodes_the_same_with_a_qwen2_config_beside_it(tmp_path):
    """transformers picks the tokenizer class from config.json's model_type once one is beside the
    tokenizer; a tokenizer trained without Qwen2's pre-tokenizer would then encode differently from
    the ids it was trained (and the model warm-started) on."""
    from emu.engine.hf_io import save_pretrained
    from emu.engine.model import LlamaModel
    from tests.support.math_data import MATH_SPEC

    texts = [r["question"] + "\n" + r["answer"] for r in rows(40)]
    out = train_bpe_tokenizer(tmp_path / "t", texts, 300)
    sample = "Ann has 123 pens. She buys 45 more.\n#### 168 caf\u00e9"
    before = HFTokenizer(out).encode(sample)
    save_pretrained(out, MATH_SPEC, LlamaModel(MATH_SPEC, seed=0).state_dict())
    assert HFTokenizer(out).encode(sample) == before


def test_stop_ids_hold_eos_and_the_generation_configs(math_dir, tmp_path):
    tok = HFTokenizer(math_dir / "model")
    assert tok.eos_id in tok.stop_ids and tok.pad_id != tok.eos_id
    other = train_bpe_tokenizer(tmp_path / "t", ["a b c"], 280)
    start = HFTokenizer(other)._tok.convert_tokens_to_ids("<|im_start|>")
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [start, 2]}))
    assert set(HFTokenizer(other).stop_ids) == {start, 2}
    (other / "generation_config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="generation_config.json: not valid JSON"):
        HFTokenizer(other)


def test_a_directory_without_a_tokenizer_or_template_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer files"):
        HFTokenizer(tmp_path)
    with pytest.raises(ConfigError, match="no such model directory"):
        HFTokenizer(tmp_path / "gone")
    bare = train_bpe_tokenizer(tmp_path / "bare", ["x y"], 270, chat_template=None)
    with pytest.raises(ConfigError, match="has no chat template"):
        HFTokenizer(bare).render("hi")


def test_a_damaged_tokenizer_directory_is_refused_before_a_job_trains_on_it(tmp_path):
    """Found by an adversarial helper (2026-12-06): without ``tokenizer.json`` AutoTokenizer built
    a two-token tokenizer from ``tokenizer_config.json`` and a job trained on prompts of EOS only,
    "succeeded"; a damaged ``tokenizer.json``, a list ``generation_config.json``, a string EOS id
    and a raising chat template were tracebacks."""
    good = train_bpe_tokenizer(tmp_path / "good", ["a b c d"], 280)
    assert HFTokenizer(good).max_token_id >= HFTokenizer(good).vocab_size - 1
    gone = train_bpe_tokenizer(tmp_path / "gone", ["a b c d"], 280)
    (gone / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer files .*tokenizer.json"):
        HFTokenizer(gone)
    (gone / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    with pytest.raises(ConfigError, match="no loadable tokenizer"):
        HFTokenizer(gone)
    for text, match in (("[2]", "expected a JSON object, got list"),
                        ('{"eos_token_id": "<|im_end|>"}', "eos_token_id: expected a token id")):
        (good / "generation_config.json").write_text(text)
        with pytest.raises(ConfigError, match=f"generation_config.json: {match}"):
            HFTokenizer(good)
    (good / "generation_config.json").unlink()
    tok = HFTokenizer(good)
    tok._tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(ConfigError, match="the chat template failed on a prompt .*no system role"):
        tok.render("hi", system_prompt="be brief")
    tok._tok.chat_template = "{{ 1 // 0 }}"   # whatever a template raises (a second helper, 2026-12-06)
    with pytest.raises(ConfigError, match="the chat template failed on a prompt .ZeroDivisionError"):
        tok.render("hi")
    tok._tok.chat_template = "{% for m in messages %}  \n{% endfor %}"
    with pytest.raises(ConfigError, match="the chat template's output .* leaves out the message 'hi'"):
        tok.render("hi")
    tok.check_round_trip("Ann has 3 pens.  She buys 7\nmore.")
    tok.decode = lambda ids: "Ann"   # a vocabulary that drops what it cannot write (no merges, 16 tokens)
    with pytest.raises(ConfigError, match="does not reproduce the dataset's text .* comes back as 'Ann'"):
        tok.check_round_trip("Ann has 3 pens.")


# ---- the task ------------------------------------------------------------------------------------


def _task(math_dir, **options):
    return get_task("math", {"dataset": "data.jsonl", **options}, base_dir=math_dir,
                    model_dir=str(math_dir / "model"))


def test_prompts_follow_the_order_and_the_held_out_split_is_apart(math_dir):
    task = _task(math_dir, eval_size=8, seed=2)
    assert task.train_size == 32 and len(task.eval_prompts()) == 8
    train_tokens = {task.prompt_at(i).tokens for i in range(32)}
    assert len(train_tokens) == 32 and not train_tokens & {p.tokens for p in task.eval_prompts()}
    again = _task(math_dir, eval_size=8, seed=2)
    assert [again.prompt_at(i) for i in (0, 31, 40)] == [task.prompt_at(i) for i in (0, 31, 40)]
    assert task.max_prompt_tokens == max(len(t) for t in train_tokens | {p.tokens for p in task.eval_prompts()})


def test_overlong_prompts_are_filtered_or_truncated_and_counted(math_dir):
    full = _task(math_dir)
    lengths = sorted(len(full.prompt_at(i).tokens) for i in range(full.train_size))
    limit = lengths[len(lengths) // 2]
    longer = sum(1 for n in lengths if n > limit)
    filtered = _task(math_dir, max_prompt_length=limit)
    assert filtered.dropped == longer and filtered.train_size == 40 - longer
    assert filtered.max_prompt_tokens <= limit
    cut = _task(math_dir, max_prompt_length=limit, overlong="truncate")
    assert cut.truncated == longer and cut.train_size == 40 and cut.max_prompt_tokens == limit
    tail = full.tokenizer._tok.decode(list(next(cut.prompt_at(i) for i in range(40)
                                                if len(cut.prompt_at(i).tokens) == limit).tokens))
    assert tail.endswith("<|im_start|>assistant\n")   # the end with the generation prompt stays
    with pytest.raises(ConfigError, match="every training prompt is longer"):
        _task(math_dir, max_prompt_length=3)
    held = _task(math_dir, eval_size=10, max_prompt_length=limit)   # the held-out split shrinks too
    assert 0 < held.eval_dropped == 10 - len(held.eval_prompts()) and held.to_dict()["eval_dropped"] == held.eval_dropped
    assert held.dropped == held.eval_dropped + (30 - held.train_size)


def test_the_verifier_scores_decoded_responses(math_dir):
    task = _task(math_dir)
    tok = task.tokenizer
    prompt = task.prompt_at(0)
    truth = prompt.reference.split("####")[-1].strip()
    assert task.score(prompt.reference, tok.encode(f"so\n#### {truth}") + [tok.eos_id]) == 1.0
    assert task.score(prompt.reference, tok.encode(f"#### {int(truth) + 1}")) == 0.0
    assert task.score(prompt.reference, []) == 0.0


def test_the_instruction_is_appended_to_each_question(math_dir):
    plain, told = _task(math_dir), _task(math_dir, instruction="Answer after ####.")
    text = told.tokenizer._tok.decode(list(told.prompt_at(0).tokens))
    assert "?\nAnswer after ####.<|im_end|>" in text and len(told.prompt_at(0).tokens) > len(plain.prompt_at(0).tokens)


@pytest.mark.parametrize("options, match", [
    ({"format": "latex"}, r"task.options.format: 'latex'"),
    ({"overlong": "drop"}, r"task.options.overlong"),
    ({"max_prompt_length": 0}, r"max_prompt_length: expected a positive integer"),
    ({"eval_size": "ten"}, r"task.options.eval_size: Input should be a valid integer"),
    ({"eval_size": 40}, r"eval_size: 40 must be >= 0 and below the dataset's 40 records"),
    ({"epochs": 3}, r"task.options.epochs: unknown key for task .math. \(options: answer_key, "),
    ({"prompt_key": "problem"}, r"row 0: task.options.prompt_key: no column 'problem'"),
    ({"dataset": "absent.jsonl"}, r"absent.jsonl: no such dataset file"),
])
def test_bad_options_are_refused_naming_the_option(math_dir, options, match):
    with pytest.raises(ConfigError, match=match):
        _task(math_dir, **options)


def test_without_a_model_directory_the_task_asks_for_a_tokenizer(math_dir):
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        get_task("math", {"dataset": "data.jsonl"}, base_dir=math_dir)
    task = get_task("math", {"dataset": "data.jsonl", "tokenizer_dir": "model"}, base_dir=math_dir)
    assert task.train_size == 40


def test_rows_the_task_cannot_use_are_refused_naming_the_row(math_dir, tmp_path):
    """Found by an adversarial helper (2026-12-06): a GSM8K reference without ``####`` had its
    leading number taken (``3 + 7 = 10`` meant 3) and ``forty-two`` scored every response 0, in
    a job that "succeeded"; a lone surrogate in a prompt was a traceback without its row."""
    import shutil

    from nereusd.tasks.verifiers import gsm8k_reference_problem

    assert gsm8k_reference_problem("42") is None and gsm8k_reference_problem("Step 1 … #### 1,000") is None
    assert gsm8k_reference_problem("3 + 7 = <<3+7=10>>10") and gsm8k_reference_problem("forty-two")
    assert gsm8k_reference_problem("#### forty")
    for read_as_its_leading_number in ("#### 3/4", "#### 1 234", "#### 1e3", "#### 12abc", "#### 5-7"):
        assert gsm8k_reference_problem(read_as_its_leading_number), read_as_its_leading_number
    for fine in ("#### 1,234", "#### -5", "#### $12.50", "42.", "100%", "#### 10%"):
        assert gsm8k_reference_problem(fine) is None, fine
    base = tmp_path / "m"
    shutil.copytree(math_dir, base)
    data = rows(12)
    for row, answer, match in ((7, "3 + 7 = <<3+7=10>>10", "neither '#### <number>' nor a bare number"),
                               (3, "#### forty", "has no number alone after its last ####")):
        _jsonl(base / "data.jsonl", [dict(r, answer=answer) if i == row else r for i, r in enumerate(data)])
        with pytest.raises(ConfigError, match=rf"data.jsonl: row {row}: answer .*{match}"):
            _task(base)
    _jsonl(base / "data.jsonl", [dict(r, answer="x " * 150) if i == 2 else r for i, r in enumerate(data)])
    with pytest.raises(ConfigError, match=r"row 2: answer .*has no \\boxed\{\} and is longer than 200"):
        _task(base, format="boxed")   # scored every response 0
    _jsonl(base / "data.jsonl", [dict(r, question="\ud800") if i == 5 else r for i, r in enumerate(data)])
    with pytest.raises(ConfigError, match="data.jsonl: row 5: the tokenizer cannot encode its prompt"):
        _task(base)
    _jsonl(base / "data.jsonl", data)
    _task(base, format="boxed")   # other forms are the MATH checker's
    config_path = base / "model" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = base / "model" / "chat_template.jinja"
    if template.exists():
        template.write_text("{# nothing #}")
    else:
        config["chat_template"] = "{# nothing #}"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="the chat template's output '' leaves out the message 'Ann has"):
        _task(base)   # an empty template (and one writing whitespace or only its markers: a helper, 2026-12-06)
