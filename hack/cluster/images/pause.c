/* The pod sandbox's pause process, written for this project: it holds the pod's namespaces,
 * reaps orphaned children (it is PID 1 of the pod when the PID namespace is shared), and exits
 * 0 on SIGINT or SIGTERM. Built with `gcc -Os -static` by hack/cluster/images/build.sh; up.sh
 * builds it too as the node's own PID 1 (its end ends every process of the node). */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction term = {.sa_handler = on_term};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &term, NULL) < 0 || sigaction(SIGTERM, &term, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0)
        return 1;
    for (;;)
        pause();
}
