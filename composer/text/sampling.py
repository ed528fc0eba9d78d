"""TextSamplingParam: the text families' sampling settings. It lives in composer/configs/text.py with the other
families' SamplingParam classes (configs/ sit below text/'s pipeline and generator); importable here as before."""

from composer.configs.text import SAMPLING_METHODS, TextSamplingParam

__all__ = ["SAMPLING_METHODS", "TextSamplingParam"]
