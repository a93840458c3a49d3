"""Math answer extraction and checking for GSM8K/MATH-style data.

The final answer of a response is, in order of preference: the content of the last `\\boxed{...}`,
the text after the last `####` (GSM8K), the text after a final "answer is", else the last number in
the response. Answers are compared after normalisation (strip `$`, spaces, trailing period,
thousands separators); numeric answers compare as numbers (fractions like `3/4` and decimals too).
Simplification: no symbolic equivalence (sympy) — `\\frac{1}{2}` and `0.5` match, `x+1` and `1+x` don't.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 1, i + len("\\boxed{")
    start = j
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[start:j - 1] if depth == 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().splitlines()[0] if text.rsplit("####", 1)[1].strip() else None
    m = re.search(r"answer is[:\s]*([^\n]+)", text, flags=re.IGNORECASE)
    if m:
        return m.group(1)
    nums = _NUM.findall(text)
    return nums[-1] if nums else None


def normalize(ans: str) -> str:
    ans = ans.strip().rstrip(".").strip().strip("$").strip()
    ans = re.sub(r"\\text\{([^}]*)\}", r"\1", ans)
    ans = re.sub(r"\\[dt]?frac\{([^}]*)\}\{([^}]*)\}", r"\1/\2", ans)
    ans = ans.replace("\\!", "").replace(" ", "").rstrip(".")
    return ans


def _as_number(ans: str) -> Fraction | None:
    s = ans.replace(",", "")
    try:
        if "/" in s:
            n, d = s.split("/", 1)
            return Fraction(Fraction(n), Fraction(d))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    p, r = normalize(predicted), normalize(reference)
    if p == r:
        return True
    pn, rn = _as_number(p), _as_number(r)
    return pn is not None and rn is not None and pn == rn


def math_reward(response: str, reference: str) -> float:
    """1.0 when the extracted final answer matches the reference, else 0.0."""
    return 1.0 if answers_match(extract_answer(response), reference) else 0.0
