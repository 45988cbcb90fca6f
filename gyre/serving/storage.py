"""Tensor storage of a process: what a cell holds, measured, and freeing a model's weights.

DESIGN.md "Cells and engines": a switch frees the state of the role it leaves, measured as
freed tensor storage. `live_tensor_bytes()` is that measure: the bytes of every distinct
torch storage that Python objects of this process reach (tensors, parameters and the
gradients of leaf tensors, on any device but `meta`), each storage counted once however
many views share it. It runs a full garbage collection first, so state dropped by the
caller but kept alive by a reference cycle does not count; it costs a walk over every
object the collector tracks (tenths of a second in a cell process).

`free_parameters(module)` drops the storage of every parameter of `module` (tied parameters
are one object, so they go together) and of their gradients, keeping the module's structure
and returning the layout (name → shape, dtype) `alloc_parameters(module, layout)` needs to
give each one uninitialised storage again, before a checkpoint is copied in. Buffers (a
rotary embedding's frequencies) are small and stay.
"""
from __future__ import annotations

import gc

import torch

Layout = dict[str, tuple[torch.Size, torch.dtype]]


def live_tensor_bytes() -> int:
    """Bytes of the distinct tensor storages this process's Python objects reach (module docstring)."""
    gc.collect()
    sizes: dict[tuple[str, int, int], int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no proxy's __class__ runs
            continue
        tensors = [obj]
        if obj.is_leaf and obj.requires_grad and obj.grad is not None:
            tensors.append(obj.grad)  # a gradient autograd wrote has no Python object of its own
        for t in tensors:
            try:
                if t.device.type == "meta" or t.is_sparse:
                    continue
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor kinds without a plain storage
                continue
            if storage.data_ptr() == 0:
                continue
            key = (t.device.type, t.device.index or 0, storage.data_ptr())
            sizes[key] = max(sizes.get(key, 0), storage.nbytes())
    return sum(sizes.values())


def free_parameters(module: torch.nn.Module) -> Layout:
    """Drop every parameter's storage and gradient; returns the layout to allocate them again."""
    layout: Layout = {}
    with torch.no_grad():
        for name, p in module.named_parameters():  # tied parameters once
            layout[name] = (p.shape, p.dtype)
            p.grad = None
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return layout


def alloc_parameters(module: torch.nn.Module, layout: Layout) -> None:
    """Give each parameter of `layout` uninitialised storage of its shape (the caller copies
    weights in). Raises KeyError when the module has no parameter of a name in it."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, (shape, dtype) in layout.items():
            p = params[name]
            p.data = torch.empty(shape, dtype=dtype, device=p.device)
