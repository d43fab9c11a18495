"""vLLM's decoding extras on the OpenAI routes: beam search and bad words.

Beam search (`use_beam_search`, with `n` beams, `length_penalty` and `early_stopping`) ranks beams by
their log-probabilities, so the fields that reshape or sample the distribution, stop on strings or
report per-token details have no meaning beside it: each is a 400 naming it, as is streaming (beams
are re-ranked until the search ends, so no token is final before then; vLLM refuses it too).
`length_penalty` and `early_stopping` without beam search are a 400 as well: nothing would read them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tgis.errors import ValidationError
from tgis.sampling.bad_words import word_sequences
from tgis.types import BeamParams

# The fields beam search cannot honour, with the values that ask for nothing.
_NOT_WITH_BEAMS: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "temperature": (None, 0, 0.0),
    "top_p": (None, 1, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": (None, {}),
    "stop": (None, [], ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (False,),
    "response_format": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "tools": (None, []),
}


def beam_params(body: Any) -> BeamParams | None:
    """The request's beam search (its width is `n`), or None; a 400 for a field beam search cannot
    honour, or a beam-search field without `use_beam_search`."""
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            raise ValidationError("length_penalty applies to beam search only: set use_beam_search")
        if body.early_stopping is not False:
            raise ValidationError("early_stopping applies to beam search only: set use_beam_search")
        return None
    for name, accepted in _NOT_WITH_BEAMS.items():
        if name not in type(body).model_fields:
            continue  # a field of the other route
        value = getattr(body, name)
        if not any(value == a and type(value) is type(a) for a in accepted):
            if name == "stream":
                raise ValidationError(
                    "use_beam_search cannot stream: beams are re-ranked until the search ends, so no "
                    "token is final before then; send stream: false"
                )
            raise ValidationError(f"{name} is not supported with use_beam_search")
    return BeamParams(width=body.n, length_penalty=body.length_penalty, early_stopping=body.early_stopping)


def bad_word_ids(
    words: Sequence[str] | None, encode: Callable[[str], Sequence[int]]
) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` as the token sequences to ban (a 400 for an empty word)."""
    if not words:
        return ()
    try:
        return word_sequences(words, encode)
    except ValueError as exc:
        raise ValidationError(str(exc)) from exc
