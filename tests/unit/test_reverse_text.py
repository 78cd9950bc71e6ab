"""reverse_text data generator and reward."""

from tidal.envs.reverse_text import SYSTEM_PROMPT, char_accuracy, conversation, generate_texts


def test_generator_is_deterministic_and_splits_are_disjoint():
    train = generate_texts("train", 2000, seed=0)
    assert train == generate_texts("train", 2000, seed=0)
    heldout = generate_texts("heldout", 300, seed=0)
    assert not set(train) & set(heldout)
    assert all(3 <= len(t) <= 10 and t.isalpha() and t.islower() for t in train + heldout)
    assert generate_texts("train", 50, seed=1) != train[:50]


def test_conversation_format_is_fixed():
    assert conversation("abc") == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": "cba"},
    ]
    assert SYSTEM_PROMPT == "Reverse the text character by character."


def test_char_accuracy_penalises_dropping_characters():
    assert char_accuracy("cba", "cba") == 1.0
    assert char_accuracy("", "cba") == 0.0
    assert char_accuracy("cb", "cba") < char_accuracy("cbx", "cba") + 1e-9
    assert char_accuracy("cbaaaa", "cba") == 0.5


def test_env_tasks_hide_the_answer_and_score_completions():
    from tidal.envs.reverse_text import ReverseTextEnv

    env = ReverseTextEnv(num_examples=50, seed=0)
    task = env.task(3)
    assert [m["role"] for m in task.messages] == ["system", "user"]
    assert task.answer == task.messages[1]["content"][::-1]
    from tidal.envs.base import Episode
    from tidal.envs.reverse_text import reversal_accuracy

    def answered(text):
        return Episode(prompt_ids=[1], messages=[*task.messages, {"role": "assistant", "content": text}])

    assert reversal_accuracy(task, answered(task.answer)) == 1.0
    assert reversal_accuracy(task, answered("")) == 0.0
    assert env.task(3) == ReverseTextEnv(num_examples=50, seed=0).task(3)
