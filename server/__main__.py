from mambaserve.server.cli import main

main()
