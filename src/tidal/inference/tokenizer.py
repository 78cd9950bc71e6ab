"""The tokenizer of a run's model, as every process that renders prompts or pads batches loads it."""

from typing import Any

from tidal.config.common import ModelConfig
from tidal.errors import UserError, first_line


def load_tokenizer(config: ModelConfig) -> Any:
    """The model's HF tokenizer, with a chat template (prompts are rendered with it) and a pad token.

    Many base models ship no pad token; padding positions are never trained on, so EOS stands in.
    """
    from transformers import AutoTokenizer

    from tidal.models import resolve_model_name

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_name(config.name), trust_remote_code=config.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"model.name = {config.name!r}: cannot load tokenizer: {first_line(exc)}") from None
    if tokenizer.chat_template is None:
        raise UserError(f"model.name = {config.name!r}: tokenizer has no chat template")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise UserError(f"model.name = {config.name!r}: tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_same_tokenizer(
    student: Any, teacher_name: str, trust_remote_code: bool = False, key: str = "orchestrator.teacher.model"
) -> None:
    """A one-line UserError, naming config `key`, unless model `teacher_name`'s tokenizer maps every token as
    `student` (a loaded tokenizer) does: a distillation teacher scores the student's token ids, which must
    mean the same text."""
    from transformers import AutoTokenizer

    from tidal.models import resolve_model_name

    key = f"{key} = {teacher_name!r}"
    try:
        teacher = AutoTokenizer.from_pretrained(
            resolve_model_name(teacher_name), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}: cannot load its tokenizer: {first_line(exc)}") from None
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours == theirs:
        return
    differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])
    token = differ[0][0]
    raise UserError(
        f"{key}: its tokenizer is not the student's ({len(theirs)} tokens against {len(ours)}; token "
        f"{token!r} is {theirs.get(token)} there and {ours.get(token)} here): the teacher would score other text "
        "than the student wrote; distil from a teacher of the same tokenizer"
    )
