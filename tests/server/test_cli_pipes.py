"""`kvserve generate` into a pipe whose reader leaves early (`| head -c 20`) ends at once and quietly, as a
Unix tool does: it logged "ERROR kvserve: [Errno 32] Broken pipe" and then never exited, its model thread
waiting for work while the interpreter joined it (issue 67)."""
import subprocess
import sys

MODEL = "smollm2-135m-instruct"


def test_generate_into_a_pipe_closed_early_exits_quietly(smollm_path):
    # counting on from "1, 2, 3," runs to max_tokens: the writes go on long after head has left
    generate = f"{sys.executable} -m server.cli generate --model {MODEL} --raw --max-tokens 300 '1, 2, 3, 4, 5,'"
    run = subprocess.run(["bash", "-c", f"{generate} | head -c 20; echo \" ${{PIPESTATUS[0]}}\" >&2"],
                         capture_output=True, timeout=300)
    stderr = run.stderr.decode(errors="replace")
    assert len(run.stdout) == 20, run.stdout
    assert stderr.rstrip().rsplit(" ", 1)[-1] in ("0", "141"), stderr[-2000:]
    for noise in ("Broken pipe", "Traceback", "ERROR", "Exception ignored"):
        assert noise not in stderr, stderr[-2000:]
