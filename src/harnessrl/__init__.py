"""harnessrl: asynchronous GRPO for LLM agents through harness interception."""

__version__ = "0.1.0"
