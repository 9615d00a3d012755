"""kvcore.threads: one OpenMP team a process — the computing thread's count, one for the others."""
import subprocess
import sys
import textwrap


def test_solo_gives_the_computing_thread_the_count_and_every_other_thread_one():
    # its own process: solo() changes torch's process-wide count
    code = textwrap.dedent("""
        import threading, torch
        from kvcore import threads
        n = threads.solo(2)
        seen = {"main": torch.get_num_threads()}
        def helper(name):
            threads.one()
            torch.ones(1 << 16).sum()
            seen[name] = torch.get_num_threads()
        def engine():
            seen["engine"] = threads.own()
            h = threading.Thread(target=helper, args=("late helper",))    # started after own()
            h.start(); h.join()
            seen["engine after"] = torch.get_num_threads()
        early = threading.Thread(target=lambda: seen.setdefault("early", torch.get_num_threads()))
        early.start(); early.join()
        t = threading.Thread(target=engine); t.start(); t.join()
        print(n, seen["main"], seen["early"], seen["engine"], seen["late helper"], seen["engine after"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "1", "1", "2", "1", "2"]


def test_without_solo_own_keeps_torchs_count():
    code = textwrap.dedent("""
        import torch
        from kvcore import threads
        before = torch.get_num_threads()
        print(before == threads.own() == torch.get_num_threads())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "True"
