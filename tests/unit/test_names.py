"""Names that cannot pass for others: what is refused, and what two look-alikes share."""

from __future__ import annotations

import sys
import unicodedata

import pytest

from orch_contracts.names import REFUSED_RANGES, name_key, normal, refusal

#: Unicode's default-ignorable code points (DerivedCoreProperties), beyond Cf.
DEFAULT_IGNORABLE = [0x034F, 0x115F, 0x1160, 0x17B4, 0x180B, 0x3164, 0xFE00, 0xFE0F, 0xFFA0]


def test_every_control_format_and_separator_character_is_refused() -> None:
    refused = {c for a, b in REFUSED_RANGES for c in range(a, b + 1)}
    for code in range(sys.maxunicode + 1):
        if unicodedata.category(chr(code)) in ("Cc", "Cf", "Zl", "Zp"):
            assert code in refused, f"U+{code:04X}"
    assert set(DEFAULT_IGNORABLE) <= refused


def test_a_refusal_names_the_class_and_the_position_not_the_name() -> None:
    assert refusal("paypal") is None
    assert refusal("é 日本 a") is None
    reason = refusal("pay\u200bpal")
    assert reason == "must not contain a format character (invisible) (U+200B at position 3)"
    assert (
        refusal("a\u2028")
        == "must not contain a line or paragraph separator (U+2028 at position 1)"
    )


@pytest.mark.parametrize(
    "alike",
    [
        "PayPal",
        "p\u0430yp\u0430l",  # Cyrillic small a
        "\u0420\u0410\u0423\u0420\u0410L",  # Cyrillic capitals (the Y is a Cyrillic U)
        "p\u03b1ypal",  # Greek small alpha
        "\u03a1\u0391YPAL",  # Greek capitals
        "\uff50\uff41\uff59\uff50\uff41\uff4c",  # fullwidth
        "\uff30\uff21\uff39\uff30\uff21\uff2c",  # fullwidth capitals
        "p\u0251ypal",  # Latin small alpha
        "\u1d18\u1d00\u028f\u1d18\u1d00\u029f",  # small capitals
        "\ua4d1AYPA\ua4e1",  # Lisu P and L
    ],
)
def test_look_alikes_share_a_key(alike: str) -> None:
    assert name_key(alike) == name_key("paypal") == "paypal"


def test_what_does_not_look_alike_keeps_its_own_key() -> None:
    keys = {name_key(n) for n in ("paypal", "paypa1", "rnail", "mail", "\u043f\u0430\u0443", "ok")}
    assert len(keys) == 6
    assert name_key("\ufb01le") == name_key("file")  # the ligature is two letters


def test_names_are_kept_in_nfc() -> None:
    assert normal("cafe\u0301") == "caf\u00e9"
    assert name_key("cafe\u0301") == name_key("caf\u00e9")
