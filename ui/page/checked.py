"""The page's Blocks, which check every input value by its field before Gradio reads it.

Gradio's own reading of an event's values (`preprocess`) refuses some values with messages that
name no field ("Value 99999 is greater than maximum value 1024.") and fails on others with a
traceback in the server's log and "the upstream Gradio app has raised an exception" for the
client: text in a number box, NaN, a value that is not among a dropdown's choices, a nested object
where text belongs. `CheckedBlocks` looks at each value first, by the control's own declared
range and choices, and refuses a bad one with the field's name (its label, and its column in
Compare), as the handlers' own checks do: a toast on the page, an error message for an API
client, one line in the log. What passes is then read by Gradio as before.
"""

from __future__ import annotations

import re

import gradio as gr

from feedback.core.bounds import Bound
from feedback.errors import FeedbackError
from ui.page import notice

_COLUMN_ID = re.compile(r"^c(?:ol)?(\d+)-")  # Compare's column controls: col2-temperature, c2-residual-alpha
_PREVIEW = 80


def field_name(component) -> str:
    """The name a refusal gives a control: its label, with its Compare column when it has one."""
    name = str(
        getattr(component, "label", None)
        or getattr(component, "elem_id", None)
        or type(component).__name__.lower()
    )
    column = _COLUMN_ID.match(getattr(component, "elem_id", None) or "")
    return f"column {column.group(1)}: {name}" if column else name


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= _PREVIEW else text[:_PREVIEW] + "…"


def _choice_values(component) -> list:
    return [c[1] if isinstance(c, (tuple, list)) else c for c in (component.choices or [])]


def _one_choice(component, value, name: str):
    if not isinstance(value, (str, int, float)):
        raise FeedbackError(f"{name} must be one of its choices, got {_shown(value)}")
    if getattr(component, "allow_custom_value", False):
        return value
    choices = _choice_values(component)
    if value not in choices:
        listed = ", ".join(map(str, choices[:12])) + (", …" if len(choices) > 12 else "")
        raise FeedbackError(f"{name} must be one of: {listed}; got {_shown(value)}")
    return value


def check_value(component, value):
    """`value` as the control may hold it, or a `FeedbackError` naming the control."""
    if value is None:
        return None  # an empty control: the handler says whether the field may be empty
    name = field_name(component)
    if isinstance(component, (gr.Number, gr.Slider)):
        integer = getattr(component, "precision", None) == 0
        number = Bound(name, component.minimum, component.maximum, integer).check(value)
        return number if integer or not isinstance(number, int) else float(number)
    if isinstance(component, gr.CheckboxGroup) or (
        isinstance(component, gr.Dropdown) and component.multiselect
    ):
        if not isinstance(value, list):
            raise FeedbackError(f"{name} must be a list of its choices, got {_shown(value)}")
        return [_one_choice(component, v, name) for v in value]
    if isinstance(component, (gr.Dropdown, gr.Radio)):
        return _one_choice(component, value, name)
    if isinstance(component, gr.Checkbox):
        if not isinstance(value, bool):
            raise FeedbackError(f"{name} must be true or false, got {_shown(value)}")
        return value
    if isinstance(component, gr.Textbox):
        if not isinstance(value, str):
            raise FeedbackError(f"{name} must be text, got {_shown(value)}")
        limit = getattr(component, "max_length", None)
        if limit is not None and len(value) > limit:
            raise FeedbackError(f"{name} is limited to {limit:,} characters, got {len(value):,}")
        return value
    return value


class CheckedBlocks(gr.Blocks):
    """`gr.Blocks` whose events check their input values by field first (see the module)."""

    async def preprocess_data(self, block_fn, inputs, state, explicit_call: bool = False):
        if not isinstance(inputs, list) or len(inputs) < len(block_fn.inputs):
            got = len(inputs) if isinstance(inputs, list) else type(inputs).__name__
            raise notice.refusal(
                f"this request sends {got} values; the endpoint takes {len(block_fn.inputs)}"
            )
        inputs = list(inputs)
        props = getattr(block_fn, "component_prop_inputs", ())
        for i, block in enumerate(block_fn.inputs):
            if getattr(block, "stateful", False) or i in props:
                continue
            live = (
                state[block._id] if state is not None and block._id in state else block
            )  # per-session choices
            try:
                inputs[i] = check_value(live, inputs[i])
            except FeedbackError as exc:
                raise notice.refusal(str(exc)) from None
        try:
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except gr.Error as exc:  # Gradio's own check of a value: its message, without the repr's quotes
            raise notice.refusal(exc.message) from None
        except (
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
            RecursionError,
        ) as exc:  # a payload Gradio cannot read
            raise notice.refusal(
                f"a value of this request could not be read: {type(exc).__name__}: {exc}"[:500]
            ) from None
