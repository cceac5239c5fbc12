"""Text in and out: the tokenizer, chat templates, stop strings, tool calls and structured-output grammars."""
