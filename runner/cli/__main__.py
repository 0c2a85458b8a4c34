from runner.cli.app import main

main()
