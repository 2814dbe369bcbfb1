"""measure_line_rate: the link speeds a lossy codec's decode sustains on this CPU."""

import pytest

from tierkv.quant import get_codec
from tierkv.quant.linerate import measure_line_rate


def test_lossless_has_no_line_rate() -> None:
    assert measure_line_rate(get_codec("none", 128), "fp16") is None


@pytest.mark.parametrize(("name", "dtype"), [("tq3", "bf16"), ("int8", "fp16"), ("k8v4", "fp32")])
def test_a_lossy_codec_reports_its_decode_and_the_links_it_beats(name: str, dtype: str) -> None:
    rate = measure_line_rate(get_codec(name, 128), dtype, threads=2)
    assert rate is not None and rate.payload_gbps > 0 and rate.threads == 2
    assert rate.ratio > 1.5  # compressed payloads: raw bytes / payload bytes
    assert rate.beats_lossless_gbit() == pytest.approx(rate.keeps_up_gbit() * rate.ratio)
    line = str(rate)
    assert line.startswith(f"{name} decode on this CPU (") and "-bit)" in line
    assert f"{rate.keeps_up_gbit():.0f} Gb/s" in line
