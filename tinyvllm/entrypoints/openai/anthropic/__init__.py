"""Anthropic's Messages API (``/v1/messages``), a translation layer onto the OpenAI chat path."""
