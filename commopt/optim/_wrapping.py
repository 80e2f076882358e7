"""What an optimizer that wraps another needs from torch.optim.Optimizer without its __init__.

Wrappers (the multi-node optimizer, LARS's layer-wise adaptation) keep every piece of state
in the optimizer they wrap; calling ``Optimizer.__init__`` would add the parameter groups a
second time. They still need the hook tables that ``Optimizer`` methods (``step`` hooks,
``state_dict`` hooks) read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

_HOOK_TABLES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def inner_attribute(name: str, inner: str) -> property:
    """A property that reads and writes ``name`` on the wrapped optimizer ``self.<inner>``.

    >>> import torch
    >>> class Wrapper:
    ...     state = inner_attribute("state", "wrapped")
    ...
    ...     def __init__(self, opt):
    ...         self.wrapped = opt
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> Wrapper(opt).state is opt.state
    True
    """

    def get(self: object) -> Any:
        return getattr(getattr(self, inner), name)

    def set_(self: object, value: Any) -> None:
        setattr(getattr(self, inner), name, value)

    return property(get, set_, doc=f"The wrapped optimizer's ``{name}``.")


def init_hook_tables(wrapper: object) -> None:
    """Give ``wrapper`` the empty hook tables ``torch.optim.Optimizer.__init__`` would."""
    for name in _HOOK_TABLES:
        setattr(wrapper, name, OrderedDict())
