from runner.commands.cli import main

main()
