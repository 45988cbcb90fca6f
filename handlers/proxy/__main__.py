from handlers.proxy.daemon import main

main()
