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


class SandboxLostError(SandboxError):
    """The machine a sandbox lives on went away (a Ray node died or stopped answering): the
    rollout is `infra_error`, whatever phase it was in."""


class SandboxLimitError(SandboxError):
    """A bound of the sandbox that the agent's own actions went past (its `disk_bytes`, an inode
    bound, the verifier's workspace-copy bounds, a filesystem it filled): the rollout scores as
    a failure with this cause (`Reward.agent_failure`), never as an unscored infrastructure
    fault."""


class HarnessInstallError(HarnessRLError):
    """An agent program could not be installed or found."""


class TaskError(HarnessRLError):
    """A task source is malformed; the message names the file, line and field."""


class RequestError(HarnessRLError):
    """A request from an agent is malformed or asks for something we cannot honour.

    `param` names the offending field (`messages[3].content`, `n`, ...); the proxy answers
    it with a 4xx status (`status_code`) and an OpenAI-style error body. Never a 5xx.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request",
                 status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code
