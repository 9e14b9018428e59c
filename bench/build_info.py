"""What a baseline binary is and what this machine offers it, for a bench's header: its
`--version` lines (llama.cpp's name its build number, commit, compiler and target) and the CPU's
vector extensions, so a figure beside llama.cpp says which build it was measured against."""
import subprocess

FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_flags() -> str:
    """The vector extensions of FLAGS this CPU offers (/proc/cpuinfo), space-separated."""
    try:
        with open("/proc/cpuinfo") as f:
            offered = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return " ".join(flag for flag in FLAGS if flag in offered) or "none of " + ",".join(FLAGS)


def describe(binary: str) -> str:
    """`binary --version` (stdout and stderr, llama.cpp writes it to stderr) and the CPU's flags."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
        version = " ".join(line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip())
    except (OSError, subprocess.TimeoutExpired) as exc:
        version = f"--version failed: {exc}"
    return f"{binary}: {version or 'no --version output'}; this CPU: {cpu_flags()}"
