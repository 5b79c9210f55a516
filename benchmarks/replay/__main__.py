from benchmarks.replay.cli import main

main()
