"""The reverse_text SFT example as a user runs it: held-out greedy exact match >= 0.9, and the exported model
reverses new strings when loaded with plain transformers."""

import pytest

from tests.conftest import run_tidal
from tidal.envs.reverse_text import SYSTEM_PROMPT
from tidal.monitor.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_reverse_text_sft_example(tmp_path):
    out = tmp_path / "sft"
    # one torch thread: `make test` runs another test on the other core meanwhile, and two threads fighting
    # it for one core made a step 3-8x slower (0.26 s alone, 0.8-2 s beside it: 632 s for the 300 steps)
    example = ("sft", "@", "examples/reverse_text/sft.toml", "--num-threads", "1")
    result = run_tidal(*example, "--output-dir", str(out), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out / "metrics.jsonl")
    exact = next(m["eval/exact_match"] for m in metrics if "eval/exact_match" in m)
    assert exact >= 0.9

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    words = [
        "tidal",
        "python",
        "qwerty",
        "abc",
        "zebras",
    ]  # 'tidal' may be in train; the rest are new strings
    correct = 0
    for word in words:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": word}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        output = model.generate(**ids, max_new_tokens=16, do_sample=False)
        answer = tokenizer.decode(output[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += answer == word[::-1]
    assert correct >= 4, correct
