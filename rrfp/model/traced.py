"""Stages from torch's tracer front end: a ``Pipe`` made by
``torch.distributed.pipelining.pipeline(module, mb_args, split_spec={...: SplitPoint...})``
(or ``pipe_split()`` markers) as rrfp stage modules.

rrfp hands each stage the previous stage's outputs, in order, as its positional inputs. So a
``Pipe`` is accepted when its split graph is that chain: stage 0 takes the model's inputs,
every later stage exactly the outputs of the stage before it. A stage that reads a model input
or an earlier stage's value (a skip across stages) is refused in one line naming it.
"""

from __future__ import annotations

import operator

from torch import nn

__all__ = ["traced_stages"]


def _stage_calls(pipe) -> list:
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    if len(calls) != pipe.num_stages:
        raise ValueError(f"a traced Pipe with {pipe.num_stages} stages but {len(calls)} stage calls: "
                         "expected one call per stage")
    return calls


def traced_stages(pipe) -> list[nn.Module]:
    """The stage modules of ``pipe``, in order: pass them to ``LocalPipeline`` or wrap stage
    ``rank``'s in a ``PipelineStage`` for ``Pipeline``.

    Raises:
        ValueError: a split graph that is not a chain (module docstring), or a parameter that
            several stages hold (torch's tracer copies a shared weight into each stage that
            uses it, and the copies do not say which weight they were; split such a model by
            hand and pass ``tied=``), naming the stage or the parameter.
    """
    calls = _stage_calls(pipe)
    for i, node in enumerate(calls[1:], start=1):
        prev = calls[i - 1]

        def of_prev(a, j=None) -> bool:
            if a is prev:
                return j is None
            return (getattr(a, "op", None) == "call_function" and a.target is operator.getitem
                    and a.args[0] is prev and (j is None or a.args[1] == j))

        if not (node.args == (prev,) or all(of_prev(a, j) for j, a in enumerate(node.args))):
            bad = next((a for a in node.args if not of_prev(a)), None)
            what = f"{bad.name!r}, not an output of stage {i - 1}" if bad is not None else \
                f"the outputs of stage {i - 1} out of order"
            raise ValueError(f"traced stage {i} takes {what}: expected exactly the outputs of stage {i - 1} "
                             "in order (rrfp runs chains of stages)")
        if node.kwargs:
            raise ValueError(f"traced stage {i} takes keyword inputs {sorted(node.kwargs)}: expected the outputs "
                             f"of stage {i - 1} as positional inputs")
    modules = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    seen: dict[str, int] = {}
    for i, m in enumerate(modules):
        for name, _ in m.named_parameters():
            if name in seen:
                raise ValueError(f"traced stages {seen[name]} and {i} both hold parameter {name!r}: torch's tracer "
                                 "copies a shared weight; split this model by hand and pass tied=")
            seen[name] = i
    return modules
