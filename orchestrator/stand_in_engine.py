"""The rehearsal's engine process: it idles until it is stopped (SIGTERM ends it)."""

import signal
import sys


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
