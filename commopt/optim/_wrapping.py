"""What an optimizer that wraps another needs from torch.optim.Optimizer without its __init__.

Wrappers (the multi-node optimizer, LARS's layer-wise adaptation) keep every piece of state
in the optimizer they wrap; calling ``Optimizer.__init__`` would add the parameter groups a
second time. They still need the hook tables that ``Optimizer`` methods (``step`` hooks,
``state_dict`` hooks) read.
"""
from __future__ import annotations

from collections import OrderedDict

_HOOK_TABLES = (
    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
)


def init_hook_tables(wrapper) -> None:
    """Give ``wrapper`` the empty hook tables ``torch.optim.Optimizer.__init__`` would."""
    for name in _HOOK_TABLES:
        setattr(wrapper, name, OrderedDict())
