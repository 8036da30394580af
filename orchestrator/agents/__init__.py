"""Agents written against the OpenAI API, trained unchanged (``rl.agent``): the endpoint that
serves them in front of the rank's engines and records each sample's tokens (``endpoint``,
``sessions``), the model's tool calls read per model family (``tool_parsers``), and the
runner that calls the agent once per sample (``runner``)."""
