"""``data.format``: what each record format is, as data -- one descriptor per format, read by the config's checks,
staging, the workers, the engines, `check` and the samples instead of branches on the format's name.

A new record format is one row here (and its name in the ``Format`` literal of ``ray_jobs/config/data.py``, which a
test holds to these rows) plus its shape: a function in ``ray_jobs/data/shapes.py`` and its row in ``SHAPES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Chat = Literal["always", "if_template", "never"]


@dataclass(frozen=True)
class RecordFormat:
    """One ``data.format``."""

    name: str
    pairs: bool = False  # preference pairs (chosen and rejected): trained by an engine that can (DPO), packed one pair
    # a row, never mixed with other formats; a sample is each row's chosen answer
    labelled: bool = False  # unpaired preference: completions labelled desirable or not (KTO's), staged one record a
    # row (its label in the row: ``ray_jobs/data/unpaired.py``), never mixed with other formats
    documents: bool = False  # free text: cut into pieces of ``seq_len`` (counted as pieces), no default
    # ``max_record_chars``, no expected answer to sample, ``text_overlap_tokens`` read and ``too_long`` not
    detected: bool = False  # ``auto``: not a format itself, but which one the first records show
    chat: Chat = "never"  # rendered by the tokenizer's chat template: every record (a tokenizer without one is
    # refused), when the tokenizer has one (else the prompt + target path), or never; all but never read ``train_on``
    no_template: str = ""  # chat="always": what to do instead, said when the tokenizer has no chat template
    train_on: str | None = None  # the ``data.train_on`` the format forces on the chat path (None: the config's)
    fields: tuple[str, ...] = ()  # the top-level fields a record has, by their names ...
    field_settings: tuple[str, ...] = ()  # ... or named by these ``data`` settings (``data.input_field``)

    @property
    def unit(self) -> str:
        """What an example of this format is counted as."""
        return "pieces" if self.documents else "records"


# In the order ``auto`` tries them on a record's fields: the first whose fields the record has is its format, so the
# formats with the most specific fields come first.
ROWS: tuple[RecordFormat, ...] = (
    # a preference record's answers are its final replies: earlier assistant turns are the prompt
    RecordFormat("preference", pairs=True, chat="if_template", train_on="last_assistant", fields=("prompt", "chosen", "rejected")),
    # before prompt_completion, whose fields it has: its completion is its final reply, as a preference record's
    RecordFormat("unpaired_preference", labelled=True, chat="if_template", train_on="last_assistant", fields=("prompt", "completion", "label")),
    RecordFormat("chat", chat="always", field_settings=("messages_field",), no_template="use data.format=pairs, or a model whose tokenizer_config.json has a chat_template"),
    RecordFormat("sharegpt", chat="always", fields=("conversations",), no_template="convert the conversations to data.format=pairs, or use a model whose tokenizer has a chat_template"),
    RecordFormat("alpaca", chat="if_template", fields=("instruction", "output")),
    RecordFormat("prompt_completion", chat="if_template", fields=("prompt", "completion")),
    RecordFormat("pairs", field_settings=("input_field", "target_field")),
    RecordFormat("text", documents=True, field_settings=("text_field",)),
    RecordFormat("auto", detected=True),
)  # fmt: skip
FORMATS: dict[str, RecordFormat] = {f.name: f for f in ROWS}


def record_format(name: str) -> RecordFormat:
    """The descriptor of ``data.format`` ``name`` (a staged manifest's format, or the config's)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"data.format={name!r} is not a record format (one of {', '.join(FORMATS)})") from None


def staged_format(name: str) -> RecordFormat:
    """The descriptor of a staged dataset's format: one of ``FORMATS``, or ``mixed`` (a mixture of several, never of
    preference pairs) or none named, which are records of no one format."""
    return FORMATS.get(name) or RecordFormat(name)
