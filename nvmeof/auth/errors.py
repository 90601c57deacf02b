"""AuthFailure: why a DH-HMAC-CHAP transaction ended, with the Failure1/Failure2 reason code explanation."""

from __future__ import annotations

from nvmeof.spec.auth import FailureReason

REASON_TEXT: dict[int, str] = {
    FailureReason.FAILED: "authentication failed",
    FailureReason.NOT_USABLE: "authentication protocol not usable",
    FailureReason.CONCAT_MISMATCH: "secure channel concatenation mismatch",
    FailureReason.HASH_UNUSABLE: "hash function not usable",
    FailureReason.DHGROUP_UNUSABLE: "DH group not usable",
    FailureReason.INCORRECT_PAYLOAD: "incorrect payload",
    FailureReason.INCORRECT_MESSAGE: "incorrect message",
}


def reason_text(code: int) -> str:
    return REASON_TEXT.get(code, f"reason code explanation {code:#04x}")


class AuthFailure(Exception):
    """A refused or unverifiable authentication; ``reason_code`` is the Reason Code Explanation (1..7).

    The message names what went wrong; it never contains a key, a challenge or a response value.
    """

    def __init__(self, reason_code: int, message: str) -> None:
        self.reason_code = int(reason_code)
        self.message = message
        super().__init__(f"{message} ({reason_text(self.reason_code)})")
