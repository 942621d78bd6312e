"""Image inputs without a model: Pillow decoding under the caps (EXIF orientation applied,
corrupt and oversized images refused by part), and remote fetching against a real HTTP server
on 127.0.0.1 — refused unless enabled, refused for loopback unless private hosts are allowed."""
from __future__ import annotations

import io
from typing import Any
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from pipeserve.errors import InvalidRequest
from pipeserve.vision.media import MediaLimits, MediaPart, decode, decode_all, from_url
from tests.media_util import chunky_png, local_server, scan_bomb_jpeg


def limits(**kw) -> MediaLimits:
    base = dict(max_image_bytes=1_000_000, max_image_pixels=1_000_000, max_images=4,
                max_request_bytes=2_000_000, allow_remote=False, allow_private=False,
                fetch_timeout_s=5.0)
    return MediaLimits(**{**base, **kw})


def jpeg(size: tuple[int, int], orientation: int | None = None) -> bytes:
    img = Image.new("RGB", size, (200, 30, 30))
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    img.save(buf, format="JPEG", exif=exif.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_the_deadline_reader_decodes_every_format_as_pillow_does(fmt: str) -> None:
    img = Image.effect_mandelbrot((300, 200), (-2, -1.5, 1, 1.5), 80).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"progressive": True} if fmt == "JPEG" else {}))
    plain = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    assert decode(buf.getvalue(), "p", limits()).image.tobytes() == plain.tobytes()


def test_an_image_slow_to_decode_is_ended_at_the_decode_limit() -> None:
    """6000x6000 flat pixels, 672 kB: 20,000 scans that each walk every block, far more work
    than the limit allows, end at media.max_image_decode_s."""
    bomb = scan_bomb_jpeg((6000, 6000), 20_000)
    big = limits(max_image_bytes=2_000_000, max_image_pixels=40_000_000, decode_s=0.5)
    with pytest.raises(InvalidRequest) as e:
        decode(bomb, "messages[0].content[0]", big)
    assert e.value.param == "messages[0].content[0]"
    assert "took longer than 0.5 s, the limit per image (media.max_image_decode_s)" in str(e.value)
    # the request's budget ends it too, whatever the per-image limit
    part = MediaPart("messages[0].content[1]", data=bomb)
    with pytest.raises(InvalidRequest) as e:
        decode_all([part], limits(max_image_bytes=2_000_000, max_image_pixels=40_000_000,
                                  decode_s=600, prepare_s=0.5))
    assert "media.max_media_prepare_s" in str(e.value) and e.value.param == part.where


def test_a_png_of_a_million_chunks_is_ended_while_its_header_is_read() -> None:
    from pipeserve.vision import media

    part = MediaPart("messages[0].content[2]", data=chunky_png(300_000))   # 3.6 MB
    short = limits(max_image_bytes=20_000_000, max_request_bytes=20_000_000, decode_s=0.2)
    with pytest.raises(InvalidRequest) as e:
        decode_all([part], short)
    assert e.value.param == part.where and "media.max_image_decode_s" in str(e.value)
    with pytest.raises(InvalidRequest):   # the pixel check's header read alone is bounded
        media._check_sizes([part], short, float("inf"))
    assert decode_all([MediaPart("p", data=chunky_png(10))], limits())[0].image.size == (64, 64)


def test_exif_orientation_is_applied() -> None:
    assert decode(jpeg((40, 20)), "p", limits()).image.size == (40, 20)
    assert decode(jpeg((40, 20), orientation=6), "p", limits()).image.size == (20, 40)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "AVIF", "HEIF", "GIF", "BMP", "TIFF"])
def test_every_listed_format_decodes(fmt: str) -> None:
    if fmt == "HEIF":
        pytest.importorskip("pillow_heif", reason="the vision extra: pip install -e '.[vision]'")
        from pillow_heif import register_heif_opener
        register_heif_opener()
    buf = io.BytesIO()
    Image.new("RGB", (24, 12), (10, 200, 30)).save(buf, format=fmt)
    assert decode(buf.getvalue(), "p", limits()).image.size == (24, 12)


def test_caps_and_corrupt_images_name_the_part() -> None:
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[2\].*could not be decoded"):
        decode(b"GIF89a-but-not-really", "messages[0].content[2]", limits())
    with pytest.raises(InvalidRequest, match=r"p: the image is 80x60 = 4800 pixels; the limit is 1000"):
        decode(jpeg((80, 60)), "p", limits(max_image_pixels=1000))
    with pytest.raises(InvalidRequest, match=r"p: the image is \d+ bytes; the limit is 100 bytes"):
        decode(jpeg((80, 60)), "p", limits(max_image_bytes=100))
    parts = [MediaPart(f"m[{i}]", data=jpeg((8, 8))) for i in range(3)]
    with pytest.raises(InvalidRequest, match=r"3 images; the limit is 2"):
        decode_all(parts, limits(max_images=2))
    with pytest.raises(InvalidRequest, match=r"m\[1\]: the request's images add up"):
        decode_all(parts, limits(max_request_bytes=len(parts[0].data) + 10))
    with pytest.raises(InvalidRequest, match="scheme 'file'"):
        from_url("file:///etc/passwd", "p")


@pytest.fixture(scope="module")
def local_images() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 serving one JPEG (and a redirect), stopped after."""
    with local_server({"/cat.jpg": (200, {"Content-Type": "image/jpeg"}, jpeg((30, 10))),
                       "/moved": (302, {"Location": "/cat.jpg"}, b"")}) as url:
        yield url


def test_remote_fetch_policy(local_images: str) -> None:
    part = from_url(f"{local_images}/cat.jpg", "messages[0].content[0]")
    with pytest.raises(InvalidRequest, match=r"content\[0\] is a remote image URL.*allow_remote_media"):
        decode_all([part], limits())
    with pytest.raises(InvalidRequest, match=r"resolves to 127\.0\.0\.1, a loopback, private"):
        decode_all([part], limits(allow_remote=True))
    got = decode_all([part], limits(allow_remote=True, allow_private=True))
    assert got[0].image.size == (30, 10)
    with pytest.raises(InvalidRequest, match=r"larger than 100 bytes"):
        decode_all([part], limits(allow_remote=True, allow_private=True, max_image_bytes=100))
    moved = from_url(f"{local_images}/moved", "p")
    with pytest.raises(InvalidRequest, match=r"HTTP 302 \(redirects are not followed\)"):
        decode_all([moved], limits(allow_remote=True, allow_private=True))


def test_a_tower_that_crashes_the_cuda_backend_is_refused_at_launch_there_only() -> None:
    """Qwen2-VL / Qwen2.5-VL towers die with SIGFPE on MLX's CUDA backend: on CUDA that family
    is a launch error naming the backend and the way out; on the CPU backend, and for Gemma 3
    on CUDA, nothing is refused."""
    from pipeserve.errors import ConfigError
    from pipeserve.vision import check_backend

    for family in ("qwen2_vl", "qwen2_5_vl"):
        with pytest.raises(ConfigError, match=f"a {family} vision-language model on MLX .*CUDA "
                                              "backend.*floating-point exception.*CPU backend"):
            check_backend(family, cuda=True)
        check_backend(family, cuda=False)
    check_backend("gemma3", cuda=True)


def test_prompt_media_token_counts_are_checked_for_every_kind() -> None:
    """After encoding, the prompt must hold exactly the image, video and audio tokens its media
    fill (a message whose text spells the token would shift every feature) and must not end in
    one; each mismatch is a 400 naming the kind and both counts."""
    from pipeserve.errors import InvalidRequest
    from pipeserve.vision.rows import PromptMedia

    IMG, VID, AUD = 900, 901, 902
    media = PromptMedia(None, {}, ["a" * 64], IMG, tokens_per_image=[2],
                        video_digests=["b" * 64], tokens_per_video=[3], video_token_id=VID,
                        audio_digests=["c" * 64], tokens_per_audio=[1], audio_token_id=AUD)
    good = [1, IMG, IMG, 2, VID, VID, VID, 3, AUD, 4]
    media.check_tokens(good)
    cases = [([1, IMG, IMG, IMG, *good[3:]], r"3 image tokens where its 1 images need 2"),
             ([1, IMG, IMG, 2, VID, VID, 3, AUD, 4], r"2 video tokens where its 1 videos need 3"),
             ([*good[:-2], 4], r"0 audio tokens where its 1 audio clips need 1"),
             ([*good[:-1]], r"prompt ends in audio")]
    for ids, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            media.check_tokens(ids)
    text_only = PromptMedia(None, {}, [], IMG)
    text_only.check_tokens([1, 2, 3])
    with pytest.raises(InvalidRequest, match=r"1 image tokens where its 0 images need 0"):
        text_only.check_tokens([1, IMG, 3])


def test_a_prompt_chunk_never_ends_inside_an_image_attended_both_ways() -> None:
    """Gemma 4 26B / 31B: the scheduler's chunk [pos, pos + n) is moved to end before an image
    that starts inside it, or after one it starts at or inside (a prompt-cache hit may start it
    there); chunks that end outside images stay as planned. With audio in the prompt the images
    stay causal (as mlx-vlm's generate): no spans, and the cache keys those images apart."""
    from types import SimpleNamespace

    from pipeserve.vision.rows import PromptMedia, image_spans

    IMG, AUD = 900, 902
    ids = [1, 2, IMG, IMG, IMG, IMG, 3, IMG, IMG, 4, 5]
    assert image_spans(ids, IMG).tolist() == [-1, -1, 0, 0, 0, 0, -1, 1, 1, -1, -1]
    both = SimpleNamespace(bidirectional=True, mrope=False)
    media = PromptMedia(both, {}, ["a" * 64, "b" * 64], IMG, tokens_per_image=[4, 2])
    media.check_tokens(ids)
    assert [media.whole_spans(0, n) for n in range(1, 10)] == [1, 2, 2, 2, 2, 6, 7, 7, 9]
    assert media.whole_spans(3, 1) == 3 and media.whole_spans(4, 4) == 3   # starts inside: end
    assert media.whole_spans(8, 2) == 2
    with_audio = PromptMedia(both, {}, ["a" * 64, "b" * 64], IMG, tokens_per_image=[4, 2],
                             audio_digests=["c" * 64], tokens_per_audio=[1],
                             audio_token_id=AUD)
    with_audio.check_tokens([*ids[:-1], AUD, 5])
    assert with_audio.blocks is None and with_audio.whole_spans(0, 3) == 3
    assert set(media.key_ids(ids)[2:6]).isdisjoint(with_audio.key_ids([*ids[:-1], AUD, 5]))


def test_a_family_not_wired_in_is_refused_at_launch_naming_it(tmp_path: Path) -> None:
    """mlx-vlm loads more families than pipeserve serves: a checkpoint of one not wired in
    (here LLaVA, GLM-4V, Idefics 3) is a launch error naming its family
    and the ones served, before any weight is read."""
    pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")
    from pipeserve.errors import ConfigError
    from pipeserve.vision.encoder import VisionEncoder

    for family in ("llava", "glm4v", "idefics3"):
        with pytest.raises(ConfigError, match=rf"is a '{family}' vision-language model; "
                                              r"pipeserve serves the mlx-vlm families .*qwen3_5, "
                                              r"qwen3_5_moe, qwen3_vl, qwen3_vl_moe so far"):
            VisionEncoder.load(tmp_path, {"model_type": family}, lm=None)


def test_dns_rebinding_cannot_reach_a_private_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that resolves to a public address for the check and to 127.0.0.1 afterwards:
    the fetch connects to the checked address only, so the private server is never asked."""
    import socket

    asked: list[str] = []
    real = socket.getaddrinfo
    answers = iter(["8.8.8.8"] + ["127.0.0.1"] * 10)   # public (unreachable here), then loopback

    def rebinding(host: str, port: Any, *args: Any, **kw: Any) -> Any:
        if host != "rebind.example":
            return real(host, port, *args, **kw)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]
    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    connected: list[str] = []
    real_connect = socket.create_connection

    def connect(address: Any, *args: Any, **kw: Any) -> Any:   # no packet leaves this host
        connected.append(address[0])
        if address[0] != "127.0.0.1":
            raise ConnectionRefusedError(f"{address[0]}: not contacted from a test")
        return real_connect(address, *args, **kw)
    monkeypatch.setattr(socket, "create_connection", connect)
    with local_server({"/cat.jpg": (200, {}, jpeg((30, 10)))}) as url:
        port = url.rsplit(":", 1)[1]
        part = from_url(f"http://rebind.example:{port}/cat.jpg", "messages[0].content[0]")
        with pytest.raises(InvalidRequest, match=r"content\[0\]: fetching the image"):
            decode_all([part], limits(allow_remote=True, fetch_timeout_s=1.0))
        asked.append(next(answers))
    assert asked == ["127.0.0.1"]   # resolved once: the second answer was never taken
    assert connected == ["8.8.8.8"]  # the checked address only, never the rebound loopback


def test_the_fetch_deadline_holds_while_headers_trickle() -> None:
    """A server that sends its status line, then one header byte every 0.1 s: each read is
    under the socket timeout, the whole fetch is not."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            try:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.0 200 OK\r\nX-Slow: ")
                for _ in range(100):   # bounded: 10 s at most
                    conn.sendall(b"a")
                    threading.Event().wait(0.1)
            except OSError:
                pass
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    part = from_url(f"http://127.0.0.1:{listener.getsockname()[1]}/x.png", "p")
    with pytest.raises(InvalidRequest, match=r"longer than 1\.0 s \(media\.media_fetch_timeout_s\)"):
        decode_all([part], limits(allow_remote=True, allow_private=True, fetch_timeout_s=1.0))
    listener.close()
    thread.join(15)


def test_a_url_with_a_port_out_of_range_is_a_400() -> None:
    part = from_url("http://example.com:99999/a.png", "messages[0].content[0]")
    with pytest.raises(InvalidRequest, match=r"content\[0\] has an invalid URL \(Port out of range"):
        decode_all([part], limits(allow_remote=True))
