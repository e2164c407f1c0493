"""The target config's errors: one problem (`ConfigError`, naming the file and the JSON path of the field),
several at once (`ConfigErrors`), and `raise_all` to raise what a check collected."""
from typing import List

from ..errors import NvmeofError


class ConfigError(NvmeofError):
    """A bad target config: the message names the file and the field path.  `transient`: a namespace's storage
    that did not answer (engine/pending.py tries it again) rather than a mistake in the file."""

    transient = False

    def __init__(self, source: str, where: str, problem: str, fix: str = ""):
        location = f"{source}: {where}" if where else source
        super().__init__(f"{location}: {problem}", fix)
        self.source = source
        self.where = where
        self.problem = problem

    def every(self) -> List["ConfigError"]:
        """Each problem this error reports: itself (ConfigErrors: all of its problems)."""
        return [self]


class ConfigErrors(ConfigError):
    """Several problems in one config, all reported at once (the first one's fields are the attributes)."""

    def __init__(self, errors: List[ConfigError]):
        first = errors[0]
        super().__init__(first.source, first.where, first.problem, first.fix)
        self.errors = list(errors)
        self.message = "\n".join(str(e) for e in errors)
        self.args = (self.message,)

    def every(self) -> List[ConfigError]:
        return list(self.errors)

    def __str__(self) -> str:
        return self.message + f"\n({len(self.errors)} problems)"


def raise_all(errors: List[ConfigError]) -> None:
    """Raise the one error, or all of them together; nothing if the list is empty."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)
