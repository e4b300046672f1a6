"""GSM8K and MATH answer verifiers: right, wrong, malformed, unicode and huge answers."""

from __future__ import annotations

import pytest

from nereusd.tasks.verifiers import gsm8k_answer, last_boxed, verify_gsm8k, verify_math

GSM8K_TRUTH = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("response, reward", [
    ("She sold 72 in total.\n#### 72", 1.0),
    ("#### 72", 1.0),
    ("####72", 1.0),
    ("#### 72.", 1.0),
    ("#### 72.0", 1.0),
    ("#### 72.00 clips", 1.0),
    ("#### +72", 1.0),
    ("#### $72", 1.0),
    ("first guess #### 70, then: #### 72", 1.0),          # the last #### counts
    ("#### 72\n", 1.0),
    ("#### 71", 0.0),
    ("#### 720", 0.0),
    ("#### 7.2", 0.0),
    ("#### -72", 0.0),
    ("The answer is 72.", 0.0),                          # no #### : not the answer format
    ("#### seventy-two", 0.0),
    ("####", 0.0),
    ("", 0.0),
    ("#### ٧٢", 0.0),                                    # Arabic-Indic digits are no GSM8K answer
    ("#### 72 #### ", 0.0),                              # the last #### has nothing after it
    ("#### " + "9" * 500, 0.0),                          # a degenerate, huge number
    ("#### 7" + "2" * 1, 1.0),
])
def test_gsm8k(response, reward):
    assert verify_gsm8k(response, GSM8K_TRUTH) == reward


@pytest.mark.parametrize("text, answer", [
    ("#### 1,234", "1234"),
    ("#### 1,234.50", "1234.5"),
    ("#### -0", "0"),
    ("#### -3", "-3"),
    ("#### .5", "0.5"),
    ("#### 10", "10"),
    ("#### 1e5", "1"),                                   # the number is 1; 'e5' is text after it
    ("no answer", None),
])
def test_gsm8k_answer_normalises(text, answer):
    assert gsm8k_answer(text) == answer


def test_gsm8k_ground_truth_may_be_the_bare_number():
    assert verify_gsm8k("#### 1,000", "1000") == 1.0
    assert verify_gsm8k("#### 3", "#### 4") == 0.0
    assert verify_gsm8k("#### 3", "not a number") == 0.0


@pytest.mark.parametrize("response, truth, reward", [
    (r"so \boxed{\frac{1}{2}}", r"\frac12", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1/2}", r"\dfrac{1}{2}", 1.0),
    (r"\boxed{2}", r"\frac{1}{2}", 0.0),
    (r"The answer is $\boxed{x^2+2x+1}$.", r"(x+1)^2", 1.0),
    (r"\boxed{\sqrt{2}}", r"\sqrt2", 1.0),
    (r"\boxed{3\pi}", r"3\pi", 1.0),
    (r"\boxed{\pi}", r"3.14", 0.0),
    (r"\boxed{10}", r"The solution ... so $\boxed{10}$.", 1.0),     # a MATH solution as ground truth
    (r"first \boxed{9} then \boxed{10}", r"10", 1.0),              # the last box counts
    (r"\fbox{10}", r"10", 1.0),
    (r"the answer is 10", r"10", 0.0),                             # no box: not the answer format
    (r"\boxed{10", r"10", 0.0),                                    # unclosed
    (r"\boxed{}", r"10", 0.0),
    (r"\boxed{\text{(A)}}", r"\text{(A)}", 1.0),
    (r"\boxed{(1,2)}", r"(1, 2)", 1.0),
    (r"\boxed{" + "9" * 500 + "}", r"9", 0.0),                     # huge: not compared
    ("\\boxed{½}", r"\frac{1}{2}", 0.0),                            # unicode vulgar fraction: not LaTeX
])
def test_math(response, truth, reward):
    assert verify_math(response, truth) == reward


def test_last_boxed_balances_braces():
    assert last_boxed(r"x \boxed{\frac{a}{b}} y") == r"\frac{a}{b}"
    assert last_boxed(r"\boxed{a} \boxed {b}") == "b"
    assert last_boxed("none") is None


def test_math_is_refused_off_the_main_thread():
    """math-verify's time limit needs SIGALRM (main thread only); without it ``(10^9)!`` never
    finishes, so a check from another thread is refused, not left unbounded."""
    import threading

    from nereusd.errors import NereusError

    got = []

    def check():
        try:
            verify_math(r"\boxed{(10^{9})!}", "1")
        except NereusError as err:
            got.append(str(err))

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and "must run in the main thread" in got[0]


def test_a_degenerate_answer_is_cut_off_by_the_time_limit():
    assert verify_math(r"\boxed{9^{9^{9^{9}}}}", "1", timeout_s=1) == 0.0


def test_gsm8k_answers_are_exact_beyond_28_digits():
    assert verify_gsm8k("#### 1234567890123456789012345678999", "1234567890123456789012345678901") == 0.0
    assert gsm8k_answer("#### 42.000000000000000000000000000000001") == "42.000000000000000000000000000000001"
