"""Command tables: each command handler is declared with its opcode and its Commands Supported and Effects
entry (docs/protocol.md §5.4), next to the handler, so the effects log is generated from what is handled.

    COMMANDS = CommandTable("I/O")

    @COMMANDS.handles(NVM_WRITE, EFFECT_CSUPP | EFFECT_LBCC)
    def _write(t, req) -> Outcome: ...

`table.handlers` is the opcode -> handler dict the core dispatches on (one dict lookup per command);
`table.effects` the opcode -> effects dict `effects_log` packs.
"""
from __future__ import annotations

from typing import Callable, Dict

from ..nvme.log import EFFECT_CSUPP, CommandEffectsLog


class CommandTable:
    """The commands of one queue kind (admin, discovery, I/O): handler and effects, declared together."""

    def __init__(self, kind: str):
        self.kind = kind
        self.handlers: Dict[int, Callable] = {}
        self.effects: Dict[int, int] = {}

    def handles(self, opcode: int, effects: int = EFFECT_CSUPP):
        """Decorator: the function handles `opcode`; the effects log reports `effects` for it."""
        if not effects & EFFECT_CSUPP:
            raise ValueError(f"{self.kind} opcode {opcode:#04x}: a handled command is supported (CSUPP)")

        def register(handler: Callable) -> Callable:
            if opcode in self.handlers:
                raise ValueError(f"{self.kind} opcode {opcode:#04x} has two handlers: "
                                 f"{self.handlers[opcode].__qualname__} and {handler.__qualname__}")
            self.handlers[opcode] = handler
            self.effects[opcode] = effects
            return handler
        return register


def effects_log(admin: CommandTable, *io: CommandTable) -> bytes:
    """The Commands Supported and Effects log page (LID 0x05) of the handlers in `admin` and the I/O tables."""
    return CommandEffectsLog(admin=dict(admin.effects), io={k: v for t in io for k, v in t.effects.items()}).pack()
