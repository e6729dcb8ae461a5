"""A saved Hugging Face model's tensors, read one by one from its safetensors files.

``save_pretrained`` writes ``model.safetensors``, or, above ``max_shard_size``, shards named in
``model.safetensors.index.json`` (``{"weight_map": {tensor name: file}}``). :class:`SafeTensors`
maps every tensor name to its file from the index (or the single file's header) and reads only
the tensors asked for, through the ``safetensors`` library's ``safe_open``: a pipeline stage
reads its own layers and never the others'. :func:`weights_problem` checks a folder the same way
without torch, before any rank starts.

Importing this module does not import torch (``safe_open(..., "np")`` reads headers without it);
:meth:`SafeTensors.get` does.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

__all__ = ["INDEX", "SINGLE", "SafeTensors", "weights_problem"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> file name (in ``folder``) of a saved model.

    Raises:
        ValueError: no ``model.safetensors`` nor index, an unreadable index, an index naming a
            missing file, or a file that is not a readable safetensors file.
    """
    from safetensors import safe_open

    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: expected JSON with a weight_map of tensor names to files ({e})") from None
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE).is_file():
        weight_map, files = None, [SINGLE]
    else:
        bins = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        extra = (f"; its {bins[0]} is not read: load it with from_pretrained and save_pretrained it again "
                 "(safetensors is the default)") if bins else ""
        raise ValueError(f"{folder}: no weights: expected {SINGLE} or {INDEX} (what save_pretrained writes){extra}")
    found: dict[str, str] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{index}: names {name}, which is not in {folder}")
        try:
            with safe_open(path, "np") as f:  # the header only; no tensor is read
                keys = list(f.keys())
        except Exception as e:  # the library raises its own SafetensorError, or OSError
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        found.update(dict.fromkeys(keys, name))
    if weight_map is not None:
        lost = sorted(k for k, v in weight_map.items() if found.get(k) != v)
        if lost:
            raise ValueError(f"{index}: names {lost[0]!r} in {weight_map[lost[0]]}, which does not hold it "
                             f"({len(lost)} such tensors)")
    return found


def weights_problem(folder: str | Path) -> str | None:
    """Why ``folder``'s weights cannot be read (one line), or None. Reads the index and the
    files' headers only (no tensor, no torch)."""
    try:
        _weight_map(Path(folder))
    except ValueError as e:
        return str(e)
    return None


class SafeTensors:
    """The tensors of a saved model's folder, read on demand.

    Use as a context manager: files are opened (memory-mapped by ``safe_open``) on first use
    and closed at exit.

    Args:
        folder: a folder ``save_pretrained`` wrote (single file or sharded).

    Attributes:
        files: tensor name -> the file (in ``folder``) that holds it.
        read: the names of the tensors read so far, in order.

    Raises:
        ValueError: as :func:`weights_problem` says.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files = _weight_map(self.folder)
        self.read: list[str] = []
        self._open: dict[str, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SafeTensors:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._open.clear()

    def find(self, name: str, base_prefix: str | None = None) -> str | None:
        """The saved name of the model's tensor ``name``: itself, or without the base model's
        prefix (``transformer.h.0...`` saved as ``h.0...`` by a ``GPT2Model``); None if absent."""
        if name in self.files:
            return name
        if base_prefix and name.startswith(base_prefix + ".") and name[len(base_prefix) + 1:] in self.files:
            return name[len(base_prefix) + 1:]
        return None

    def get(self, key: str):
        """Tensor ``key`` (a saved name) as a CPU ``torch.Tensor`` in its saved dtype.

        Raises:
            KeyError: ``key`` is not saved in this folder.
        """
        from safetensors import safe_open

        file = self.files[key]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(self.folder / file, "pt", device="cpu"))
        self.read.append(key)
        return self._open[file].get_tensor(key)
