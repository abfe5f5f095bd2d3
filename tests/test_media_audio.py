"""A video with a soundtrack (server/media/videos.py): its MP4 holds an AAC stream beside the H.264
one, both from 0, the tone written decoding back at its pitch and length; "audio.wav" holds the
track exactly, as a float WAV a standard reader (FFmpeg's) takes; without one, nothing changes."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from server.media.videos import VARIANTS, Soundtrack, read_wav, video_files, wav

FPS, FRAMES, RATE, TONE = 24, 9, 16000, 1000.0
COUNT = RATE * FRAMES // FPS  # 6000 samples: exactly the clip's 9/24 s
AAC_FRAME = 1024


def clip() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.random((FRAMES, 32, 32, 3), dtype=np.float32)


def tone(channels: int, amplitude: float = 0.5) -> Soundtrack:
    t = np.arange(COUNT) / RATE
    wave = amplitude * np.sin(2 * np.pi * TONE * t)
    return Soundtrack(np.stack([wave] * channels).astype(np.float32), RATE)


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[spectrum.argmax()])


@pytest.mark.parametrize("channels", [2, 1])
def test_the_mp4_has_the_tone_as_an_aac_stream_beside_the_video(channels: int) -> None:
    mp4 = video_files(clip(), FPS, tone(channels))["video.mp4"]
    with av.open(io.BytesIO(mp4)) as container:
        assert [s.type for s in container.streams] == ["video", "audio"]
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.frames) == ("h264", FRAMES)
        assert (audio.codec_context.name, audio.codec_context.channels, audio.rate) == ("aac", channels, RATE)
        # in step: both start at 0 (the edit list hides the encoder's priming), the audio as long
        # as the track
        assert video.start_time * video.time_base == 0 == audio.start_time * audio.time_base
        assert audio.duration * audio.time_base == pytest.approx(COUNT / RATE)
        decoded = list(container.decode(audio))
    assert decoded[0].pts == 0
    sound = np.concatenate([frame.to_ndarray() for frame in decoded], axis=1)
    assert sound.shape[0] == channels
    # whole AAC frames: the last one padded out, the priming dropped
    assert COUNT <= sound.shape[1] <= COUNT + AAC_FRAME
    for channel in sound:  # lossy: the pitch survives, not the samples
        assert dominant_hz(channel[:COUNT], RATE) == pytest.approx(TONE, abs=RATE / COUNT)
        assert np.abs(channel[AAC_FRAME:COUNT]).max() == pytest.approx(0.5, abs=0.1)


def test_samples_past_full_scale_are_clipped_for_aac_and_kept_in_the_wav() -> None:
    loud = tone(2, amplitude=3.0)
    files = video_files(clip(), FPS, loud)
    samples, _ = read_wav(files["audio.wav"])
    assert np.array_equal(samples, loud.samples) and samples.max() > 2.9
    with av.open(io.BytesIO(files["video.mp4"])) as container:
        sound = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    assert np.abs(sound).max() < 1.5  # a square wave at full scale (with AAC's ringing), not 3.0
    assert dominant_hz(sound[0, :COUNT], RATE) == pytest.approx(TONE, abs=RATE / COUNT)


@pytest.mark.parametrize("channels", [2, 1])
def test_the_wav_holds_the_exact_samples_under_a_float_header(channels: int) -> None:
    track = Soundtrack(np.random.default_rng(1).normal(0, 0.7, (channels, COUNT)).astype(np.float32), RATE)
    data = video_files(clip(), FPS, track)["audio.wav"]
    samples, rate = read_wav(data)
    assert samples.dtype == np.float32 and rate == RATE
    assert np.array_equal(samples, track.samples)
    # the header, field by field: RIFF, an 18-byte fmt of IEEE float, fact, data
    assert (data[:4], struct.unpack_from("<I", data, 4)[0], data[8:12]) == (b"RIFF", len(data) - 8, b"WAVE")
    assert (data[12:16], struct.unpack_from("<I", data, 16)[0]) == (b"fmt ", 18)
    fmt = struct.unpack_from("<HHIIHHH", data, 20)
    assert fmt == (3, channels, RATE, RATE * channels * 4, channels * 4, 32, 0)
    assert (data[38:42], struct.unpack_from("<II", data, 42)) == (b"fact", (4, COUNT))
    assert (data[50:54], struct.unpack_from("<I", data, 54)[0]) == (b"data", channels * COUNT * 4)
    assert len(data) == 58 + channels * COUNT * 4
    # a standard reader takes it: FFmpeg's WAV demuxer finds the same float samples
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.rate, stream.codec_context.channels) == (
            "pcm_f32le",
            RATE,
            channels,
        )
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
    # packed (interleaved) float frames: [1, n × channels]
    assert np.array_equal(np.concatenate(frames, axis=1).reshape(-1, channels).T, track.samples)


def test_scipy_reads_the_wav() -> None:
    wavfile = pytest.importorskip("scipy.io.wavfile")
    track = tone(2)
    rate, samples = wavfile.read(io.BytesIO(wav(track)))
    assert rate == RATE and samples.dtype == np.float32 and np.array_equal(samples.T, track.samples)


def test_read_wav_skips_chunks_it_does_not_need() -> None:
    track = tone(1)
    data = wav(track)
    odd = b"LIST" + struct.pack("<I", 3) + b"abc" + b"\0"  # an odd-sized chunk and its pad byte
    data = data[:4] + struct.pack("<I", len(data) - 8 + len(odd)) + data[8:12] + odd + data[12:]
    samples, rate = read_wav(data)
    assert rate == RATE and np.array_equal(samples, track.samples)


def test_without_a_soundtrack_nothing_changes() -> None:
    files = video_files(clip(), FPS)
    assert sorted(files) == ["frames.zip", "spritesheet.png", "thumbnail.png", "video.mp4"]
    assert files == video_files(clip(), FPS, None)
    with av.open(io.BytesIO(files["video.mp4"])) as container:
        assert [s.type for s in container.streams] == ["video"]
        assert container.streams.video[0].frames == FRAMES
    assert VARIANTS["audio"] == ("audio.wav", "audio/wav")
    with_sound = video_files(clip(), FPS, tone(2))
    assert sorted(with_sound) == ["audio.wav", *sorted(files)]
    # the other variants are the same bytes: only the MP4 and the WAV differ
    assert all(with_sound[name] == files[name] for name in files if name != "video.mp4")


@pytest.mark.parametrize(
    ("samples", "rate"),
    [(np.zeros(100, np.float32), RATE), (np.zeros((3, 100), np.float32), RATE), (np.zeros((2, 0)), RATE)],
)
def test_a_soundtrack_of_the_wrong_shape_is_refused(samples: np.ndarray, rate: int) -> None:
    with pytest.raises(ValueError, match="channels"):
        Soundtrack(samples, rate)


def test_a_rate_aac_does_not_take_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="17000 Hz"):
        video_files(clip(), FPS, Soundtrack(np.zeros((1, 100), np.float32), 17000))
