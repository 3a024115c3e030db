"""One exception type per boundary.

Programmer errors and infrastructure that cannot work raise these and stop the run; faults of
an agent, a sandboxed command or a verifier are recorded on the rollout instead (DESIGN.md §3.4).
Every message names the offending field or value.
"""


class HarnessRLError(Exception):
    """Base class of harnessrl's own errors."""


class ConfigError(HarnessRLError):
    """A config file or option is invalid; the message names the key."""


class EngineError(HarnessRLError):
    """The engine cannot serve a request (bad prompt, context exceeded, engine stopped)."""


class ContextLengthError(EngineError):
    """The prompt leaves no room for a completion within the engine's context window."""


class ModelLoadError(HarnessRLError):
    """A model could not be found, converted or loaded."""


class SandboxError(HarnessRLError):
    """The sandbox backend itself failed (not a command inside it)."""


class HarnessInstallError(HarnessRLError):
    """An agent program could not be installed or found."""


class TaskError(HarnessRLError):
    """A task source is malformed; the message names the file, line and field."""
