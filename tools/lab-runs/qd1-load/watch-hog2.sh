out=/tmp/qd1/both
while [ ! -e $out/want-hog2 ] && [ ! -e $out/rc ]; do sleep 1; done
[ -e $out/rc ] && exit 0
sh -c "while :; do :; done" & hog=$!
echo $hog > $out/hog2.pid; date -u +%s > $out/hog2-start; touch $out/hog2-on
while [ ! -e $out/rc ]; do sleep 2; done
kill $hog; date -u +%s > $out/hog2-stop
