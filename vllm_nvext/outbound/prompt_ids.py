"""The prompt ids a stream reports, kept as vLLM wrote them until something reads them decoded.

`finish.first_chunk` keeps a plain first chunk's prompt ids as bytes (`keep_prompt_json`): a list
`_json.dumps` writes back to the same bytes, so the byte-level finish chunk (`finish.finish_chunk`)
copies them (`chunks.ChunkReshaper.finish_first_choice`) and only another reader (a decoded chunk, the general path)
decodes them. Same bytes as decoding them: tests/unit/test_stream_finish.py.
"""

from __future__ import annotations

from typing import Any

from .. import _json


class PromptIds:
    """`prompt_ids` (None: none reported yet), decoded on first read when only their bytes were kept.

    A base class: its owner sets both slots to None when it is made (`chunks.ChunkReshaper`).
    """

    __slots__ = ("_prompt_ids", "_prompt_json")
    _prompt_ids: Any
    _prompt_json: bytes | None  # kept undecoded (keep_prompt_json) until something reads them

    @property
    def prompt_ids(self) -> Any:
        """The prompt ids vLLM reported; None: none yet."""
        if self._prompt_json is not None:
            self._prompt_ids, self._prompt_json = _json.loads(self._prompt_json), None
        return self._prompt_ids

    @prompt_ids.setter
    def prompt_ids(self, value: Any) -> None:
        self._prompt_ids, self._prompt_json = value, None

    def keep_prompt_json(self, value: bytes) -> None:
        """vLLM's prompt ids as a plain chunk holds them: a list, in the bytes `_json.dumps` gives for its
        decode. Ids already known stay (the first report counts, as `ChunkReshaper.reshape` keeps it)."""
        if self._prompt_ids is None and self._prompt_json is None:
            self._prompt_json = value
