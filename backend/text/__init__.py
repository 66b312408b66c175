"""Text processing for MiniMax-M3: tokenizer, chat template, detokenizer, stop strings, parsers."""

from .chat_template import render_chat_template
from .detokenizer import IncrementalDetokenizer
from .reasoning import THINK_END, THINK_START, MiniMaxM3ReasoningParser, extract as extract_reasoning
from .stop_strings import StopStringMatcher
from .tiny_tokenizer import M3_SPECIAL_TOKENS, build_tiny_tokenizer
from .tokenizer import Tokenizer
from .tool_parser import CALL_END, CALL_START, NS, ToolCallStreamParser, forced_call_prefix, parse_tool_calls

__all__ = [
    "CALL_END",
    "CALL_START",
    "IncrementalDetokenizer",
    "M3_SPECIAL_TOKENS",
    "MiniMaxM3ReasoningParser",
    "NS",
    "StopStringMatcher",
    "THINK_END",
    "THINK_START",
    "Tokenizer",
    "ToolCallStreamParser",
    "build_tiny_tokenizer",
    "extract_reasoning",
    "forced_call_prefix",
    "parse_tool_calls",
    "render_chat_template",
]
